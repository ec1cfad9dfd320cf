#!/usr/bin/env bash
# What the level grids and the codebook refits cost in served quality (issue #12, docs/encoding.md):
# glm5_nano encoded from one calibration with each --base_levels (uniform, the default, and lloyd;
# uniform_nested on request) and each --codebook_refinements asked for, then `nq kld` at all 2 bits
# and all 4 bits on the first N tokens of each held-out domain. Prints a table; the runs' outputs
# stay in OUT (default .run/base-grid).
#
#   bash bench/quality/base_grid_kld.sh [OUT]
#   NQ_KLD_TOKENS=1024  tokens per domain;  NQ_BUILD=build/cpu  where nq is built
#   NQ_GRIDS="uniform lloyd"  the --base_levels values encoded
#   NQ_REFINEMENTS="0 1"  the --codebook_refinements values encoded (default: nq encode's own)
#   NQ_CALIB=0  encode without the calibration Hessians (identity: no LDLQ), as models too large
#               for `nq calibrate` are encoded (docs/encoding.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.run/base-grid}
nq=${NQ_BUILD:-build/cpu}/services/tools/nq
per_domain=${NQ_KLD_TOKENS:-1024}
readonly src=models/glm5_nano window=1024
mkdir -p "$out/model" "$out/tokens"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
  cp "$src/$f" "$out/model/$f"
done
python3 - "$per_domain" "$out/tokens" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
for d in ["stdlib_code", "stdlib_tests", "libs_code", "docstrings"]:
    json.dump(json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:n], open(f"{out}/{d}.json", "w"))
PY
tokens=$(ls "$out"/tokens/*.json | paste -sd, -)
# The embedded model's recipe (scripts/embedded_model.sh): one calibration for both encodes.
"$nq" calibrate --model "$out/model" --tokens "$src/calibration.tokens" --out "$out/calibration" >/dev/null
read -r -a grids <<< "${NQ_GRIDS:-uniform lloyd}"
read -r -a refinements <<< "${NQ_REFINEMENTS:-default}"
runs=()
for grid in "${grids[@]}"; do
  for refits in "${refinements[@]}"; do
    run="$grid-$refits"
    runs+=("$run")
    args=()
    [[ "$refits" != default ]] && args=(--codebook_refinements "$refits")
    [[ "${NQ_CALIB:-1}" != 0 ]] && args+=(--calib "$out/calibration")
    rm -rf "$out/release-$run"
    "$nq" encode --model "$out/model" --out "$out/release-$run" --fixed-per-layer 4 \
      --base_levels "$grid" "${args[@]}" >/dev/null 2>&1
    for mode in all-2-bit all-4-bit; do
      "$nq" kld --teacher "$out/model" --release "$out/release-$run" --tokens "$tokens" --window $window \
        --mode "$mode" --out "$out/$run-$mode.json" > "$out/$run-$mode.txt"
    done
  done
done
python3 - "$out" "${runs[@]}" <<'PY'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
print("| base levels | refits | mode | mean KL | median KL | p99 KL | top-1 |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
for run in runs:
    grid, refits = run.rsplit("-", 1)
    for mode in ["all-2-bit", "all-4-bit"]:
        r = json.load(open(f"{out}/{run}-{mode}.json"))
        s = r.get("summary", r)
        print(f"| {grid} | {refits} | {mode} | {s['mean_kl']:.5f} | {s['median_kl']:.5f} | {s['p99_kl']:.4f} | {s['top1_agreement']:.4f} |")
PY
