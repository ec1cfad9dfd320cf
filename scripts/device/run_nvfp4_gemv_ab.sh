#!/usr/bin/env bash
# One device call that checks and times the NVFP4 expert GEMV's kernels side by side (issue
# #20): the TMA kernel (the default where it applies, kernels/cuda/nvfp4_gemv_tma.cuh) and the
# register kernel (NQ_NVFP4_GEMV=regs). For each: the CUDA-vs-CPU tests; then
# nvfp4_moe_bench for every kernel; compute-sanitizer memcheck and racecheck over the default;
# hbm_probe.py (the yardsticks, when .hbm/hbm_probe.py is carried); nvfp4_moe_bench again.
# Everything lands in $OUT/nvfp4_gemv_ab_log.txt (the tool returns a few files only). Every
# step has a time limit (a kernel that never completes its barriers would otherwise hang the
# call).
#
#   cmake --build build/cuda --target nvfp4_moe_bench cuda_vs_cpu_ops_test
#   bash scripts/device/package.sh build/cuda && rm -f .device/bin/{cpu_ops_test,cuda_model_test,nq_moe_bench,mla_decode_bench}
#   mkdir -p .hbm && cp ../shared/tools/hbm_probe.py .hbm/ && bash scripts/device/slim_tree.sh on
#   # the `run` tool: carry [".device", ".hbm"], command: bash scripts/device/run_nvfp4_gemv_ab.sh
#   bash scripts/device/slim_tree.sh off
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/nvfp4_gemv_ab}"
mkdir -p "$out"
exec > >(tee "$out/nvfp4_gemv_ab_log.txt") 2>&1
readonly dev="$PWD/.device"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
[[ -f "$dev/MANIFEST" ]] && head -n 1 "$dev/MANIFEST"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
readonly kernels=(${NQ_AB_KERNELS:-tma regs})
status=0
usable=()
bench_round() {
  for k in "${usable[@]}"; do
    echo "== nvfp4_moe_bench NQ_NVFP4_GEMV=$k (round $1)"
    NQ_NVFP4_GEMV="$k" timeout 90 "$dev/bin/nvfp4_moe_bench" ${NQ_BENCH_ARGS:-} || status=1
  done
}
# The tests first; a kernel whose tests time out (barriers never completing) is not timed.
for k in "${kernels[@]}"; do
  echo "== CudaNvfp4Moe* with NQ_NVFP4_GEMV=$k"
  NQ_NVFP4_GEMV="$k" timeout 150 "$dev/bin/cuda_vs_cpu_ops_test" --gtest_filter='CudaNvfp4Moe*' --gtest_brief=1
  rc=$?
  ((rc != 0)) && status=1
  ((rc != 124)) && usable+=("$k")
done
bench_round 1
echo "== compute-sanitizer memcheck (default kernel, small shapes)"
NQ_SANITIZE_SMALL=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 "$dev/bin/cuda_vs_cpu_ops_test" \
  --gtest_filter='CudaNvfp4Moe*' --gtest_brief=1 2>&1 | tail -4 || status=1
# NQ_AB_QUICK=1: one benchmark round, no racecheck and no hbm_probe (a confirmation run).
if [[ "${NQ_AB_QUICK:-0}" == 1 ]]; then exit "$status"; fi
echo "== compute-sanitizer racecheck (default kernel, small shapes)"
NQ_SANITIZE_SMALL=1 timeout 120 compute-sanitizer --tool racecheck --error-exitcode 3 "$dev/bin/cuda_vs_cpu_ops_test" \
  --gtest_filter='CudaNvfp4Moe.MatchesCpu' --gtest_brief=1 2>&1 | tail -4 || status=1
if [[ -f .hbm/hbm_probe.py ]]; then
  echo "== hbm_probe.py"
  timeout 240 python3 .hbm/hbm_probe.py 2>&1
fi
bench_round 2
exit "$status"
