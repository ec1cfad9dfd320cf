# Sourced first (after `set -uo pipefail`) by the device scripts that run a .devspec bundle:
#   source "$(dirname "$0")/devspec_prelude.sh" DIR
# moves to the repository root, sets out ($OUT, or ./out here) and makes it, sources the bundle,
# token and slice helpers (devspec_bundle.sh, compare_tokens.sh, slice_bench.sh), and unpacks the
# bundle into DIR (B = its bin/); the script exits if it cannot. Also defines
#   ops_tests FILTER [MEMCHECK_FILTER]  # the bundle's cuda_vs_cpu_ops_test over FILTER into
#                                       # $out/tests.txt, then compute-sanitizer memcheck over
#                                       # MEMCHECK_FILTER (default FILTER) into $out/memcheck.txt where
#                                       # the machine has it; a summary on stdout; non-zero on a failure
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out="${OUT:-$PWD/out}"
mkdir -p "$out"
source scripts/device/devspec_bundle.sh  # unpack_devspec_bundle
source scripts/device/compare_tokens.sh  # compare_tokens
source scripts/device/slice_bench.sh     # make_bench_slice, bench_slice
unpack_devspec_bundle "$1" || exit 1
ops_tests() {
  local filter="$1" checked="${2:-$1}" rc=0
  "$B/cuda_vs_cpu_ops_test" --gtest_filter="$filter" >"$out/tests.txt" 2>&1 || rc=1
  grep -E "timing|^\[  (PASSED|FAILED)|FAILED" "$out/tests.txt" | tail -8
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck "$B/cuda_vs_cpu_ops_test" --gtest_filter="$checked" >"$out/memcheck.txt" 2>&1 || rc=1
    grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$out/memcheck.txt"
  fi
  return "$rc"
}
