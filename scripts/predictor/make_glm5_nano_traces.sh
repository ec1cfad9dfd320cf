#!/usr/bin/env bash
# glm5_nano's routing traces for the learned predictor (issue #21), written gzipped to
# bench/predictor/glm5_nano/ (committed: train_predictor.sh trains from them on the GPU
# machine, which has no nq build):
#   train.nqrt.gz    training-split text (scripts/train/calibration_text.py: stdlib files the
#                    model's training split kept, never a held-out one), windows of 1024 tokens,
#                    one sequence each; NQ_JF_TRAIN_CHARS characters (default 200,000)
#   heldout.nqrt.gz  the quality table's text: the first 4096 tokens of each of the four
#                    models/glm5_nano/eval domains, windows of 1024 (16 sequences, 16,384 tokens)
#
#   bash scripts/predictor/make_glm5_nano_traces.sh      # needs build/cpu/services/tools/nq
set -euo pipefail
cd "$(dirname "$0")/../.."
nq=${NQ_BIN:-build/cpu/services/tools/nq}
out=bench/predictor/glm5_nano
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
python3 scripts/train/calibration_text.py --chars "${NQ_JF_TRAIN_CHARS:-200000}" > "$work/train.txt"
"$nq" tokenize --tokenizer models/glm5_nano/tokenizer.json < "$work/train.txt" > "$work/train.tokens"
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
window = 1024
ids = [int(x) for x in open(f"{work}/train.tokens").read().replace("\n", ",").split(",") if x.strip()]
with open(f"{work}/train.lines", "w") as f:
    for i in range(0, len(ids) - window + 1, window):
        f.write(",".join(map(str, ids[i:i + window])) + "\n")
with open(f"{work}/heldout.lines", "w") as f:
    for d in ["docstrings", "libs_code", "stdlib_code", "stdlib_tests"]:
        ids = json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:4096]
        for i in range(0, len(ids), window):
            f.write(",".join(map(str, ids[i:i + window])) + "\n")
PY
for split in train heldout; do
  "$nq" trace --model models/glm5_nano --tokens "$work/$split.lines" --out "$work/$split.nqrt"
  gzip -9 -n -c "$work/$split.nqrt" > "$out/$split.nqrt.gz"
done
ls -la "$out"
