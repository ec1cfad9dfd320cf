#!/usr/bin/env bash
# The README's test command (CI runs it too): installs what is missing, builds the CPU
# preset, runs every test, then the sanitizer stage (scripts/sanitize.sh ci: ThreadSanitizer
# over the concurrent units, AddressSanitizer + UBSan over a sample; about 21 more minutes on
# 2 cores from scratch). Extra arguments go to ctest (e.g. -R cluster) and skip the sanitizer
# stage, as does NQ_SANITIZERS=0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$(nproc)"
ctest --preset cpu -j "$(nproc)" "$@"
if (($# == 0)) && [[ "${NQ_SANITIZERS:-1}" != 0 ]]; then
  bash scripts/sanitize.sh ci
fi
