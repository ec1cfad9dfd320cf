#!/usr/bin/env bash
# One device call for issue #23's long-prompt figures on the H200, over the .gpu-cluster bundle
# (scripts/device/package_cluster.sh): a GLM-5-shaped slice (scripts/device/make_slice.sh: 1
# dense + NQ_PREFILL_MOE_LAYERS MoE layers of GLM-5's shapes, NQ_PREFILL_EXPERTS routed experts
# each, default 256 as GLM-5 has, max_position_embeddings NQ_MAX_POSITIONS), then
# `nq bench-prefill` at each of NQ_PREFILL_LENGTHS (default 4096,32768) under each policy of
# NQ_PREFILL_POLICIES, one process each, in this order:
#   2-bit        token order, every routed expert at 2 bits (--layer_major_prefill_tokens=0)
#   layer-major-2-bit  layer-major with no 4-bit experts (--prefill-expert-slots=0): what the
#                layer order costs by itself
#   layer-major  the worker's default: spans of 2048+ tokens layer-major, each layer's routed
#                experts at 4 bits read from the release through the io_uring store (O_DIRECT)
#   all-4-bit    token order with every routed expert resident at 4 bits (the ceiling)
# NQ_PREFILL_ROUNDS requests per length (default 2: a worker's first layer-major prefill sizes its
# reads by length, later ones by measured time). Results in $OUT: prefill-<policy>.json and
# .log, the slice's build log, and summary.txt (one line per row, ratios to 2-bit).
# NQ_PREFILL_TIMEOUT (s, default 240) bounds each policy's process.
#
#   run tool: carry [".gpu-cluster"], command "bash scripts/device/run_long_prefill.sh"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-prefill-out}"
mkdir -p "$OUT"
stamp() { echo "-- $(date +%T) $*"; }

source scripts/device/unpack_cluster_bundle.sh  # $work, LD_LIBRARY_PATH
B=$work/bin
slice=$work/slice
moe_layers="${NQ_PREFILL_MOE_LAYERS:-2}"
experts="${NQ_PREFILL_EXPERTS:-256}"
lengths="${NQ_PREFILL_LENGTHS:-4096,32768}"
rounds="${NQ_PREFILL_ROUNDS:-2}"
max_positions="${NQ_MAX_POSITIONS:-131200}"
limit="${NQ_PREFILL_TIMEOUT:-240}"

stamp "slice: glm5, 1 + $moe_layers layers, $experts experts, $max_positions positions"
if ! NQ="$B/nq" NQ_MAX_POSITIONS="$max_positions" bash scripts/device/make_slice.sh glm5 "$slice" \
    $((moe_layers + 1)) "$experts" 0 >"$OUT/slice.log" 2>&1; then
  echo "make_slice.sh failed:"; tail -20 "$OUT/slice.log"; exit 1
fi
tail -2 "$OUT/slice.log"
df -h "$slice" | tail -1
findmnt -T "$slice" -o SOURCE,FSTYPE | tail -1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

for policy in ${NQ_PREFILL_POLICIES:-2-bit layer-major-2-bit layer-major all-4-bit}; do
  case "$policy" in
    2-bit) flags=(--expert-bits=2 --layer-major-prefill-tokens=0) ;;
    layer-major-2-bit) flags=(--expert-bits=2 --prefill-expert-slots=0) ;;
    layer-major) flags=(--expert-bits=2) ;;
    all-4-bit) flags=(--expert-bits=4 --layer-major-prefill-tokens=0) ;;
    *) echo "unknown policy $policy"; continue ;;
  esac
  stamp "bench-prefill $policy"
  timeout "$limit" "$B/nq" bench-prefill --model="$slice" --release="$slice/release" --backend=cuda \
    --weight-dtype=bf16 --kv-cache-dtype=bf16 --prefill-lengths="$lengths" --prefill-rounds="$rounds" \
    "${flags[@]}" --out="$OUT/prefill-$policy.json" >"$OUT/prefill-$policy.log" 2>&1
  echo "exit $?"
  grep -vE "^\s*$" "$OUT/prefill-$policy.log" | tail -n 12
done

python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
runs = {}
for policy in ("2-bit", "layer-major-2-bit", "layer-major", "all-4-bit"):
    path = os.path.join(out, f"prefill-{policy}.json")
    if os.path.exists(path):
        runs[policy] = json.load(open(path))["rows"]
def best(rows, tokens):
    # The last round of a length: a worker's steady state (the first sizes its reads by length).
    picked = [r for r in rows if r["prompt_tokens"] == tokens]
    return picked[-1] if picked else None
lengths = sorted({r["prompt_tokens"] for rows in runs.values() for r in rows})
for tokens in lengths:
    base = best(runs.get("2-bit", []), tokens)
    for policy, rows in runs.items():
        for r in (x for x in rows if x["prompt_tokens"] == tokens):
            ratio = base["tokens_per_second"] and r["tokens_per_second"] / base["tokens_per_second"] if base else 0
            print(f"{tokens:7d} {policy:11s} round {r['round']}: {r['seconds']:.3f} s to first token, "
                  f"{r['tokens_per_second']:.0f} tokens/s ({ratio:.3f} of 2-bit's last round), 4-bit share "
                  f"{r['share_4bit']:.3f}, records prefetched {r['records_prefetched_used']} late {r['records_read_late']}, "
                  f"read {r['read_bytes_per_second'] / 1e9:.2f} GB/s, layer compute {r['seconds_per_token_layer'] * 1e6:.2f} us/token")
PY
