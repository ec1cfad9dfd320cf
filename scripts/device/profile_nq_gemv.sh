#!/usr/bin/env bash
# One device call that explains where the NestQuant decode GEMV's time goes (issue #12): the
# quick benchmark, then Nsight Compute's full set on the first gate/up and down GEMV of the
# DeepSeek-V3 1-token 2-bit block (warp stall reasons, pipe utilisation, memory), with the SASS
# source counters and the kernel's resource usage written to $OUT for reading here.
#
#   bash scripts/device/build_cuda.sh --kernels-only && bash scripts/device/package.sh build/cuda-kernels
#   bash scripts/device/slim_tree.sh on
#   # the `run` tool: carry [".device"], command: bash scripts/device/profile_nq_gemv.sh
#   bash scripts/device/slim_tree.sh off
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/nq_profile}"
mkdir -p "$out"
exec > >(tee "$out/profile_log.txt") 2>&1
readonly dev="$PWD/.device"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
status=0
if [[ "${NQ_SKIP_TESTS:-0}" != 1 ]]; then
  echo "== cuda_vs_cpu_ops_test (NqMoe)"
  "$dev/bin/cuda_vs_cpu_ops_test" --gtest_filter='CudaNqMoe*' --gtest_brief=1 || status=1
fi
echo "== nq_moe_bench --quick"; "$dev/bin/nq_moe_bench" --quick || status=1
# A/B switches of the decode GEMV under study (kernels/cuda/nq_moe_gemv.cu), each "VAR=value".
for variant in ${NQ_GEMV_VARIANTS:-}; do
  echo "== nq_moe_bench --quick with $variant"; env "$variant" "$dev/bin/nq_moe_bench" --quick || status=1
done
if command -v cuobjdump >/dev/null; then
  cuobjdump -res-usage "$dev/bin/nq_moe_bench" 2>/dev/null | grep -A1 -E "NqGemv|NqRotate|NqSwiglu|NqCombine" \
    > "$out/res_usage.txt"
  cuobjdump -sass -fun NqGemvKernel "$dev/bin/nq_moe_bench" > "$out/gemv_sass.txt" 2>/dev/null ||
    cuobjdump -sass "$dev/bin/nq_moe_bench" 2>/dev/null | awk '/Function : .*NqGemv/{p=1} /Function : /&&!/NqGemv/{p=0} p' \
      > "$out/gemv_sass.txt"
fi
echo "== ncu --set full: the first two NqGemvKernel launches (gate/up, down; DeepSeek-V3, 1 token, 2 bits)"
ncu --set full -k regex:NqGemvKernel --launch-count "${NQ_NCU_LAUNCHES:-2}" --import-source no \
  -o "$out/gemv" -f "$dev/bin/nq_moe_bench" --quick > "$out/ncu_run.txt" 2>&1 || status=1
tail -5 "$out/ncu_run.txt"
ncu -i "$out/gemv.ncu-rep" --page details --print-details all > "$out/ncu_details.txt" 2>&1 || status=1
ncu -i "$out/gemv.ncu-rep" --page source --print-source sass --csv > "$out/ncu_source.csv" 2>&1 || status=1
grep -E "Duration|Elapsed Cycles|SM Frequency|DRAM Throughput|Memory Throughput|Issued Ipc|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Achieved Occupancy|Registers Per Thread" \
  "$out/ncu_details.txt" | head -60
gzip -f "$out/ncu_source.csv"
exit "$status"
