#!/usr/bin/env bash
# The layering rule (DESIGN.md section 10), checked two ways:
#  1. no source outside services/tools includes a header from it;
#  2. cmake/NqLayering.cmake really fails a configure whose service links the tools folder
#     through a library, and passes one that does not (so the build's own check can fail).
set -euo pipefail
src="$1"
bad=$(grep -rl --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh' \
  '#include "services/tools/' "$src/services" "$src/kernels" | grep -v "^$src/services/tools/" || true)
if [[ -n "$bad" ]]; then
  echo "layering: these files include the CLI's headers (services/tools):"; echo "$bad"; exit 1
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
if cmake -S "$src/tests/layering/project" -B "$work/broken" -DNQ_SOURCE_DIR="$src" >"$work/broken.log" 2>&1; then
  echo "layering: a service linking the tools folder configured without error"; cat "$work/broken.log"; exit 1
fi
grep -q "layering: service links cli_lib" "$work/broken.log" || { echo "layering: wrong error:"; cat "$work/broken.log"; exit 1; }
cmake -S "$src/tests/layering/project" -B "$work/clean" -DNQ_SOURCE_DIR="$src" -DNQ_BREAK_RULE=OFF >"$work/clean.log" 2>&1 ||
  { echo "layering: a clean project was refused:"; cat "$work/clean.log"; exit 1; }
echo "layering: ok"
