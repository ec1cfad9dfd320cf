#!/usr/bin/env bash
# The README's test command (CI runs it too): installs what is missing, builds the CPU
# preset, and runs every test. Extra arguments go to ctest (e.g. -R cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$(nproc)"
ctest --preset cpu -j "$(nproc)" "$@"
