#!/usr/bin/env bash
# Issue #16's low-rank rows: glm5_nano encoded with and without low-rank corrections
# (`nq encode --lowrank_rank R --lowrank_outlier_threshold T`, the same calibration and fixed set
# as the embedded release), then `nq kld` all-2-bit, fixed-set and all-4-bit on the same held-out
# tokens as bench/quality/run_kld.sh. Results go to OUT (default .run/lowrank_kld); bench/README.md
# quotes them.
#
#   bash bench/quality/run_kld_lowrank.sh [OUT]      (scalar: ~15 min on 2 loaded cores;
#                                                      NQ_CODEC=trellis: two ~25 min encodes more)
#   NQ_CODEC=scalar|trellis  NQ_LOWRANK_RANKS="1 2 4"  NQ_LOWRANK_THRESHOLD=8  NQ_KLD_TOKENS=4096
#   NQ_BUILD=build/cpu
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.run/lowrank_kld}
build=${NQ_BUILD:-build/cpu}
nq=$build/services/tools/nq
codec=${NQ_CODEC:-scalar}
ranks=${NQ_LOWRANK_RANKS:-4}
threshold=${NQ_LOWRANK_THRESHOLD:-8}
per_domain=${NQ_KLD_TOKENS:-4096}
readonly model=models/glm5_nano window=1024 slots=8
mkdir -p "$out/tokens"
"$nq" calibrate --model "$model" --tokens "$model/calibration.tokens" --out "$out/calibration.safetensors" >/dev/null 2>&1
python3 - "$per_domain" "$out/tokens" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
for d in ["stdlib_code", "stdlib_tests", "libs_code", "docstrings"]:
    ids = json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:n]
    json.dump(ids, open(f"{out}/{d}.json", "w"))
PY
tokens=$(ls "$out"/tokens/*.json | paste -sd, -)
for rank in 0 $ranks; do
  release=$out/${codec}_r${rank}
  lowrank=()
  ((rank > 0)) && lowrank=(--lowrank_rank "$rank" --lowrank_outlier_threshold "$threshold")
  "$nq" encode --model "$model" --out "$release" --calib "$out/calibration.safetensors" --fixed-per-layer 4 \
    --codec "$codec" "${lowrank[@]}" > "$release.encode.txt" 2>&1
  grep "low-rank" "$release.encode.txt" || true
  for mode in all-2-bit fixed-set all-4-bit; do
    "$nq" kld --teacher "$model" --release "$release" --tokens "$tokens" --window $window --slots $slots \
      --out "$release.$mode.json" --mode "$mode" > "$release.$mode.txt" 2> "$release.$mode.log"
    echo "rank $rank $mode $(grep '^| all' "$release.$mode.txt") $(grep 'bits per weight' "$release.$mode.txt")"
  done
done
