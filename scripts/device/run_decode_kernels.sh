#!/usr/bin/env bash
# One device call for the decode-step kernels (issue #13; scripts/device/README.md): every CUDA
# kernel test against the CPU backend, the model against HF's reference logits when
# cuda_model_test was packed, compute-sanitizer memcheck and racecheck on the small MLA and
# indexer cases, then mla_decode_bench (--sweep: every split count), the indexer timing,
# nq_moe_bench (and a second build of it as .device/bin/nq_moe_bench_alt, for A/B runs) and
# shared/tools/hbm_probe.py when carried in .hbm/. Everything printed lands in
# $OUT/decode_kernels_log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then exec > >(tee "$OUT/decode_kernels_log.txt") 2>&1; fi
readonly dev="$PWD/.device"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
[[ -f "$dev/MANIFEST" ]] && head -n 1 "$dev/MANIFEST"
nvidia-smi -L
failed=()
step() {
  local name="$1"
  shift
  echo "== $name"
  local start=$SECONDS
  if "$@"; then echo "== $name: passed ($((SECONDS - start)) s)"; else
    echo "== $name: FAILED ($((SECONDS - start)) s)"
    failed+=("$name")
  fi
}
readonly small="${NQ_SANITIZE_FILTER:-CudaMlaAttention.*:CudaMlaDecode*:CudaIndexerTopK.Tiny*:CudaMatMul*}"
step cuda_vs_cpu_ops_test "$dev/bin/cuda_vs_cpu_ops_test" --gtest_color=no ${NQ_GTEST_FILTER:+--gtest_filter=$NQ_GTEST_FILTER}
[[ -x "$dev/bin/cuda_model_test" ]] && step cuda_model_test "$dev/bin/cuda_model_test" --gtest_color=no --gtest_brief=1
if [[ "${NQ_DEVICE_SANITIZE:-1}" == 1 ]]; then
  for tool in memcheck racecheck; do
    NQ_SANITIZE_SMALL=1 step "compute-sanitizer $tool" compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$dev/bin/cuda_vs_cpu_ops_test" --gtest_filter="$small" --gtest_brief=1
  done
fi
if [[ "${NQ_PROFILE:-0}" == 1 ]]; then
  # The MLA decode kernels of the first bench case (16 heads, 4096 keys), one launch each.
  echo "== ncu: MLA decode kernels"
  ncu --kernel-name regex:Mla --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats "$dev/bin/mla_decode_bench" --quick 2>&1 |
    grep -E "Mla[A-Za-z]*Kernel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Issued Warp|No Eligible|Stall|Warp Cycles Per Issued" | head -80
fi
step mla_decode_bench "$dev/bin/mla_decode_bench" ${NQ_MLA_BENCH_ARGS:---sweep}
step nq_moe_bench "$dev/bin/nq_moe_bench" --quick
[[ -x "$dev/bin/nq_moe_bench_alt" ]] && step nq_moe_bench_alt "$dev/bin/nq_moe_bench_alt" --quick
[[ -f .hbm/hbm_probe.py ]] && step hbm_probe python3 .hbm/hbm_probe.py
echo "failed: ${failed[*]:-none}"
[[ ${#failed[@]} == 0 ]]
