#!/usr/bin/env bash
# Issue #23's prefill quality and speed on glm5_nano (CPU): `nq kld --prefill_tokens` with the
# prompt prefilled at 2 bits, layer-major with its own 4-bit experts, and all at 4 bits; the
# continuation decoded with the fixed set in every case. Results go to OUT (default
# .run/prefill); bench/README.md quotes the table.
#
#   bash bench/prefill/run_prefill_kld.sh [OUT]
#   NQ_PREFILL_WINDOWS=2    windows per domain (each the next 2048 tokens of the eval file)
#   NQ_FULL_SPAN=1536       --full_span_tokens of the layer-major policy (1536: every expert the
#                           prompt routes; 32768, the worker's default, holds 1536/32768 of them)
#   NQ_BUILD=build/cpu
#   NQ_PREFILL_MODES="..."  the policies to run (default: 2-bit layer-major-4-bit all-4-bit)
#   NQ_MODEL_DIR=DIR        the embedded model and release to use (default OUT/model)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.run/prefill}
build=${NQ_BUILD:-build/cpu}
nq=$build/services/tools/nq
windows=${NQ_PREFILL_WINDOWS:-2}
full_span=${NQ_FULL_SPAN:-1536}
readonly window=2048 prompt=1536 chunk=512
mkdir -p "$out/tokens"
# The embedded default and its release (prepared once; NQ_MODEL_DIR reuses one already made,
# e.g. build/cpu/embedded-model, which the tests prepare).
model=${NQ_MODEL_DIR:-$out/model}
NQ_BIN=$nq bash scripts/embedded_model.sh "$model" >/dev/null
python3 - "$((windows * window))" "$out/tokens" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
for d in ["stdlib_code", "stdlib_tests", "libs_code", "docstrings"]:
    ids = json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:n]
    json.dump(ids, open(f"{out}/{d}.json", "w"))
PY
tokens=$(ls "$out"/tokens/*.json | paste -sd, -)
for mode in ${NQ_PREFILL_MODES:-2-bit layer-major-4-bit all-4-bit}; do
  "$nq" kld --teacher "$model" --release "$model/release" --tokens "$tokens" --window $window \
    --prefill_tokens $prompt --prefill_chunk_tokens $chunk --full_span_tokens "$full_span" --prefill_mode "$mode" \
    --out "$out/$mode.json" > "$out/$mode.txt"
  echo "== $mode"; cat "$out/$mode.txt"
done
