#!/usr/bin/env bash
# One device call for issue #12 (scripts/device/README.md): the NestQuant MoE kernels against the
# CPU backend, optionally under compute-sanitizer (NQ_DEVICE_SANITIZE=1), then the benchmark
# (nq_moe_bench), the BF16 prefill yardstick and shared/tools/hbm_probe.py when carried in .hbm/.
# Everything printed also lands in $OUT/nq_moe_log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then exec > >(tee "$OUT/nq_moe_log.txt") 2>&1; fi
readonly dev="$PWD/.device"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuBLAS (and NCCL) from the machine's CUDA wheels: the binaries link them dynamically.
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
nvidia-smi -L
status=0
echo "== cpu_ops_test (NqMoe)"; "$dev/bin/cpu_ops_test" --gtest_filter='CpuNqMoe*' --gtest_brief=1 || status=1
echo "== cuda_vs_cpu_ops_test (NqMoe)"; "$dev/bin/cuda_vs_cpu_ops_test" --gtest_filter='CudaNqMoe*' || status=1
if [[ "${NQ_DEVICE_SANITIZE:-0}" == 1 ]]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"
    NQ_SANITIZE_SMALL=1 compute-sanitizer --tool "$tool" --error-exitcode 3 "$dev/bin/cuda_vs_cpu_ops_test" \
      --gtest_filter='CudaNqMoe*' --gtest_brief=1 || status=1
  done
fi
if [[ "${NQ_PROFILE:-0}" == 1 ]]; then
  # The seven kernels of one DeepSeek-V3-shaped decode step (the bench's first, uncaptured launch).
  echo "== ncu: one decode step, kernel by kernel"
  ncu --launch-count 7 --section SpeedOfLight --section Occupancy --section LaunchStats \
    "$dev/bin/nq_moe_bench" --quick 2>&1 | grep -E "NqRotate|NqPrep|NqGemv|NqSwiglu|NqCombine|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Block Limit" | head -80
fi
echo "== nq_moe_bench"; "$dev/bin/nq_moe_bench" ${NQ_BENCH_ARGS:-} || status=1
echo "== bf16 prefill yardstick"; python3 bench/gpu/bf16_moe_prefill.py || status=1
if [[ -f .hbm/hbm_probe.py ]]; then echo "== hbm_probe"; python3 .hbm/hbm_probe.py || status=1; fi
exit "$status"
