#!/usr/bin/env bash
# What the level grids cost in served quality (issue #12, docs/encoding.md): glm5_nano encoded from
# one calibration with each --base_levels (uniform, the default, and lloyd; uniform_nested on
# request), then `nq kld` at all 2 bits and all 4 bits on the first N tokens of each held-out
# domain. Prints a table; the runs' outputs stay in OUT (default .run/base-grid).
#
#   bash bench/quality/base_grid_kld.sh [OUT]
#   NQ_KLD_TOKENS=1024  tokens per domain;  NQ_BUILD=build/cpu  where nq is built
#   NQ_GRIDS="uniform lloyd"  the --base_levels values encoded
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
for grid in "${grids[@]}"; do
  rm -rf "$out/release-$grid"
  "$nq" encode --model "$out/model" --out "$out/release-$grid" --calib "$out/calibration" --fixed-per-layer 4 \
    --base_levels "$grid" >/dev/null 2>&1
  for mode in all-2-bit all-4-bit; do
    "$nq" kld --teacher "$out/model" --release "$out/release-$grid" --tokens "$tokens" --window $window \
      --mode "$mode" --out "$out/$grid-$mode.json" > "$out/$grid-$mode.txt"
  done
done
python3 - "$out" "${grids[@]}" <<'PY'
import json, sys
out, grids = sys.argv[1], sys.argv[2:]
print("| base levels | mode | mean KL | median KL | p99 KL | top-1 |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
for grid in grids:
    for mode in ["all-2-bit", "all-4-bit"]:
        r = json.load(open(f"{out}/{grid}-{mode}.json"))
        s = r.get("summary", r)
        print(f"| {grid} | {mode} | {s['mean_kl']:.5f} | {s['median_kl']:.5f} | {s['p99_kl']:.4f} | {s['top1_agreement']:.4f} |")
PY
