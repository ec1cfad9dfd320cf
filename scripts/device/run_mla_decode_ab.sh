#!/usr/bin/env bash
# On the device: the MLA decode kernels' checks, then mla_decode_bench for the build before a
# change (.device/base/mla_decode_bench, when present) and after (.device/bin), alternating, so
# their figures come from one machine and one run. Results under $OUT (or ./out).
#
# Here: build mla_decode_bench and cuda_vs_cpu_ops_test (build/cuda), strip them into
# .device/bin, the base bench into .device/base, copy_shared_libs (scripts/device/shared_libs.sh)
# into .device/lib, slim_tree.sh on; the `run` tool: carry [".device", ".hbm"], command
#   bash scripts/device/run_mla_decode_ab.sh
# NQ_MLA_BUILDS (the .device folders to time, in order: "base bin"; a folder's optional `env` file
# holds VAR=value lines for its runs: the same binary under another setting), NQ_MLA_ROUNDS (2),
# NQ_MLA_ONLY (a case-name substring for --only), NQ_GTEST_FILTER ('CudaMla*:CudaWriteRows*'),
# NQ_SANITIZE_FILTER ('CudaMlaDecode.*:CudaMlaAttention.Decode*'; empty skips compute-sanitizer),
# NQ_MLA_NCU (case-name substrings separated by commas: ncu's view of each MLA kernel of the first
# such case, per build, in $OUT/ncu_<build>_<n>.txt; each kernel launched alone, caches flushed).
set -uo pipefail
out="${OUT:-$PWD/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/.device/lib:$(bash scripts/device/cuda_wheel_libs.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee "$out/gpu.txt"
status=0
timeout 300 .device/bin/cuda_vs_cpu_ops_test --gtest_filter="${NQ_GTEST_FILTER:-CudaMla*:CudaWriteRows*}" \
  --gtest_brief=1 >"$out/tests.txt" 2>&1 || status=1
tail -25 "$out/tests.txt"
sanitize="${NQ_SANITIZE_FILTER-CudaMlaDecode.*:CudaMlaAttention.Decode*}"
if [[ -n "$sanitize" ]] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    NQ_SANITIZE_SMALL=1 timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      .device/bin/cuda_vs_cpu_ops_test --gtest_filter="$sanitize" --gtest_brief=1 \
      >"$out/sanitize_$tool.txt" 2>&1 || status=1
    echo "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.txt" | tail -1)"
  done
fi
if [[ -f .hbm/hbm_probe.py ]]; then timeout 120 python3 .hbm/hbm_probe.py >"$out/hbm_probe.txt" 2>&1; fi
only=()
[[ -n "${NQ_MLA_ONLY:-}" ]] && only=(--only "$NQ_MLA_ONLY")
for round in $(seq 1 "${NQ_MLA_ROUNDS:-2}"); do
  for build in ${NQ_MLA_BUILDS:-base bin}; do
    [[ -x ".device/$build/mla_decode_bench" ]] || continue
    echo "== round $round, $build"
    # .device/<build>/env (optional): VAR=value lines exported for this build's run only.
    env_vars=()
    [[ -f ".device/$build/env" ]] && mapfile -t env_vars < ".device/$build/env"
    env "${env_vars[@]}" timeout 300 ".device/$build/mla_decode_bench" "${only[@]}" \
      >"$out/bench_${build}_$round.txt" 2>&1 || status=1
    grep -E "copy|split" "$out/bench_${build}_$round.txt"
  done
done
if [[ -n "${NQ_MLA_NCU:-}" ]] && command -v ncu >/dev/null; then
  IFS=, read -r -a ncu_cases <<<"$NQ_MLA_NCU"
  for build in ${NQ_MLA_BUILDS:-base bin}; do
    [[ -x ".device/$build/mla_decode_bench" ]] || continue
    for i in "${!ncu_cases[@]}"; do
      report="$out/ncu_${build}_$i.txt"
      timeout 150 ncu --clock-control none --kernel-name regex:Mla --launch-skip 12 --launch-count 4 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats ".device/$build/mla_decode_bench" --quick --only "${ncu_cases[$i]}" \
        >"$report" 2>&1 || status=1
      echo "== ncu $build: ${ncu_cases[$i]}"
      grep -E "Mla[A-Za-z]+Kernel|^ +Duration|One or More Eligible|Achieved Occupancy" "$report" | sed -E 's/ +/ /g'
    done
  done
fi
exit "$status"
