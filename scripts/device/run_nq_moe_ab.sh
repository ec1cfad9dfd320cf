#!/usr/bin/env bash
# One device call that checks a change to the NestQuant MoE kernels and times it against the build
# before it, side by side on the same GPU (scripts/device/README.md):
#   here, before the change:  cmake --build build/cuda --target nq_moe_bench
#                             mkdir -p .device/base && cp build/cuda/tests/kernels/nq_moe_bench .device/base/
#   after it:                 cmake --build build/cuda --target cuda_vs_cpu_ops_test cpu_ops_test nq_moe_bench
#                             bash scripts/device/package.sh   (keeps nothing of .device: copy base/ back in)
#   the `run` tool: carry [".device", ".hbm"], command "bash scripts/device/run_nq_moe_ab.sh"
# Environment: NQ_AB_TEST (the test binary in .device/bin, default cuda_vs_cpu_ops_test),
# NQ_GTEST_FILTER (default CudaNqMoe*), NQ_AB_BENCH (the benchmark binary's name in
# .device/bin and .device/base, default nq_moe_bench), NQ_AB_ARGS (its argument sets, one per line;
# a line "VAR=value ... -- args" runs with those variables set, for variants one build selects at
# run time), NQ_AB_ROUNDS (default 2), NQ_AB_GREP (the benchmark's lines kept, an extended regular
# expression), NQ_SANITIZE_FILTER (memcheck and racecheck over it, small cases; empty: none),
# NQ_SANITIZE_TOOLS (default "memcheck racecheck"). Without a .device/base build the rounds run the new one alone. Everything
# lands in $OUT/ab_log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq_moe_ab}"; mkdir -p "$OUT"
exec > >(tee "$OUT/ab_log.txt") 2>&1
readonly dev="$PWD/.device"
export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
t0=$SECONDS
stamp() { echo "-- $(date +%T) +$((SECONDS - t0))s $*"; }
nvidia-smi -L
[[ -f "$dev/MANIFEST" ]] && head -n 1 "$dev/MANIFEST"
status=0

test_bin="$dev/bin/${NQ_AB_TEST:-cuda_vs_cpu_ops_test}"
stamp "tests: ${NQ_GTEST_FILTER:-CudaNqMoe*}"
"$test_bin" --gtest_filter="${NQ_GTEST_FILTER:-CudaNqMoe*}" 2>&1 |
  grep -E "compare|PASSED|FAILED|Failure|Expected|Which is|trace|error|OK \]" | grep -v "^\[       OK" | head -80
(( PIPESTATUS[0] == 0 )) || status=1

default_args=$'--quick --codec=scalar\n--quick --codec=scalar --lowrank=4'
mapfile -t arg_sets <<< "${NQ_AB_ARGS:-$default_args}"
bench="${NQ_AB_BENCH:-nq_moe_bench}"
for round in $(seq 1 "${NQ_AB_ROUNDS:-2}"); do
  for line in "${arg_sets[@]}"; do
    vars=""; args="$line"
    if [[ "$line" == *" -- "* ]]; then vars="${line%% -- *}"; args="${line#* -- }"; fi
    for which in base new; do
      bin="$dev/bin/$bench"; [[ $which == base ]] && bin="$dev/base/$bench"
      [[ -x "$bin" ]] || continue
      stamp "round $round, $which: $vars $bench $args"
      # shellcheck disable=SC2086  # an argument set (and a variable set) is several words
      timeout 120 env $vars "$bin" $args 2>&1 | grep -E "${NQ_AB_GREP:-copy|T=|tokens|grouped|dense|rror|us}" || status=1
    done
  done
done

if [[ -n "${NQ_SANITIZE_FILTER:-}" ]]; then
  for tool in ${NQ_SANITIZE_TOOLS:-memcheck racecheck}; do
    stamp "compute-sanitizer $tool: $NQ_SANITIZE_FILTER"
    NQ_SANITIZE_SMALL=1 timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 3 "$test_bin" \
      --gtest_filter="$NQ_SANITIZE_FILTER" --gtest_brief=1 2>&1 | tail -4
    echo "$tool rc=${PIPESTATUS[0]}"
  done
fi
if [[ -f .hbm/hbm_probe.py ]]; then stamp hbm_probe; python3 .hbm/hbm_probe.py 2>&1 | head -8; fi
stamp done
exit "$status"
