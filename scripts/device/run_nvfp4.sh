#!/usr/bin/env bash
# One device call for issue #20 (scripts/device/README.md): the NVFP4 expert kernels against the
# CPU backend, the same tests under compute-sanitizer memcheck (small shapes), then the benchmark
# (nvfp4_moe_bench: GB/s and the ratio to the device copy bandwidth measured in the same run).
# Everything printed also lands in $OUT/nvfp4_log.txt; the benchmark's lines in
# $OUT/nvfp4_bench.txt. Exits non-zero if any step fails.
#
#   bash scripts/device/build_cuda.sh && bash scripts/device/package.sh   # here, then carry .device
#   bash scripts/device/run_nvfp4.sh                                      # there
#   NQ_BENCH_ARGS=--quick ...   DeepSeek-V3 shapes only;  NQ_TEST_SEED=N ...  replays a test run
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then exec > >(tee "$OUT/nvfp4_log.txt") 2>&1; fi
readonly dev="$PWD/.device"
for b in cpu_ops_test cuda_vs_cpu_ops_test nvfp4_moe_bench; do
  if [[ ! -x "$dev/bin/$b" ]]; then
    echo "run_nvfp4.sh: $dev/bin/$b missing: run build_cuda.sh and package.sh here and carry .device" >&2
    exit 2
  fi
done
[[ -f "$dev/MANIFEST" ]] && head -n 1 "$dev/MANIFEST"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuBLAS (and NCCL) from the machine's CUDA wheels: the binaries link them dynamically.
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
if ldd "$dev/bin/cuda_vs_cpu_ops_test" 2>&1 | grep -q "not found"; then
  echo "run_nvfp4.sh: this machine's C++ runtime is older than the build machine's; using .device/compat"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dev/compat"
fi
nvidia-smi -L
status=0
echo "== cpu_ops_test (Nvfp4Moe)"
"$dev/bin/cpu_ops_test" --gtest_filter='CpuNvfp4Moe*' --gtest_brief=1 || status=1
echo "== cuda_vs_cpu_ops_test (Nvfp4Moe)"
"$dev/bin/cuda_vs_cpu_ops_test" --gtest_filter='CudaNvfp4Moe*' || status=1
echo "== compute-sanitizer memcheck (Nvfp4Moe, small shapes)"
NQ_SANITIZE_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 3 "$dev/bin/cuda_vs_cpu_ops_test" \
  --gtest_filter='CudaNvfp4Moe*' --gtest_brief=1 || status=1
echo "== nvfp4_moe_bench"
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
  "$dev/bin/nvfp4_moe_bench" ${NQ_BENCH_ARGS:-} | tee "$OUT/nvfp4_bench.txt" || status=1
else
  "$dev/bin/nvfp4_moe_bench" ${NQ_BENCH_ARGS:-} || status=1
fi
exit "$status"
