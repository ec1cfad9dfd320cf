# Sourced first (after `set -uo pipefail`) by the device scripts that run a .devspec bundle:
#   source "$(dirname "$0")/devspec_prelude.sh" DIR
# moves to the repository root, sets out ($OUT, or ./out here) and makes it, sources the bundle,
# token and slice helpers (devspec_bundle.sh, compare_tokens.sh, slice_bench.sh), and unpacks the
# bundle into DIR (B = its bin/); the script exits if it cannot.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out="${OUT:-$PWD/out}"
mkdir -p "$out"
source scripts/device/devspec_bundle.sh  # unpack_devspec_bundle
source scripts/device/compare_tokens.sh  # compare_tokens
source scripts/device/slice_bench.sh     # make_bench_slice, bench_slice
unpack_devspec_bundle "$1" || exit 1
