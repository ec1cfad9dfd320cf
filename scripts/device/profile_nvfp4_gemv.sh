#!/usr/bin/env bash
# One device call that explains where the NVFP4 expert GEMV's time goes (issue #20): the quick
# benchmark (the block, and its two GEMVs alone), then Nsight Compute's full set on the first
# gate/up and down Nvfp4GemvKernel launches (DeepSeek-V3, 1 token), with the kernel's SASS and
# resource usage written to $OUT for reading here.
#
#   cmake --build build/cuda --target nvfp4_moe_bench cuda_vs_cpu_ops_test cpu_ops_test
#   bash scripts/device/package.sh build/cuda && bash scripts/device/slim_tree.sh on
#   # the `run` tool: carry [".device"], command: bash scripts/device/profile_nvfp4_gemv.sh
#   bash scripts/device/slim_tree.sh off
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/nvfp4_profile}"
mkdir -p "$out"
exec > >(tee "$out/nvfp4_profile_log.txt") 2>&1
readonly dev="$PWD/.device"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
status=0
echo "== nvfp4_moe_bench --quick"; "$dev/bin/nvfp4_moe_bench" --quick || status=1
if command -v cuobjdump >/dev/null; then
  cuobjdump -res-usage "$dev/bin/nvfp4_moe_bench" 2>/dev/null | grep -A1 -E "Nvfp4" > "$out/nvfp4_res_usage.txt"
  cuobjdump -sass "$dev/bin/nvfp4_moe_bench" 2>/dev/null |
    awk '/Function : .*Nvfp4GemvKernel/{p=1} /Function : /&&!/Nvfp4GemvKernel/{p=0} p' > "$out/nvfp4_gemv_sass.txt"
  gzip -f "$out/nvfp4_gemv_sass.txt"
fi
echo "== ncu --set full: the first two Nvfp4GemvKernel launches (gate/up, down; DeepSeek-V3, 1 token)"
ncu --set full -k regex:Nvfp4GemvKernel --launch-count "${NQ_NCU_LAUNCHES:-2}" --import-source no \
  -o "$out/nvfp4_gemv" -f "$dev/bin/nvfp4_moe_bench" --quick > "$out/nvfp4_ncu_run.txt" 2>&1 || status=1
tail -3 "$out/nvfp4_ncu_run.txt"
ncu -i "$out/nvfp4_gemv.ncu-rep" --page details --print-details all > "$out/nvfp4_ncu_details.txt" 2>&1 || status=1
ncu -i "$out/nvfp4_gemv.ncu-rep" --page source --print-source sass --csv > "$out/nvfp4_ncu_source.csv" 2>&1 || status=1
rm -f "$out/nvfp4_gemv.ncu-rep"
grep -E "Duration|Elapsed Cycles|SM Frequency|DRAM Throughput|Memory Throughput|Issued Ipc|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Achieved Occupancy|Registers Per Thread|L1/TEX Hit|L2 Hit" \
  "$out/nvfp4_ncu_details.txt" | head -60
gzip -f "$out/nvfp4_ncu_source.csv" "$out/nvfp4_ncu_details.txt"
exit "$status"
