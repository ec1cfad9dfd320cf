#!/usr/bin/env bash
# One device call for issue #21: trains the learned predictor jF for glm5_nano on the GPU
# machine (python3 + torch only; nothing built, nothing carried) from the routing traces
# committed in bench/predictor/glm5_nano/ (training-split text; held-out text for evaluation,
# the same 16,384 tokens as the quality table), and writes into $OUT/jf/:
#   model.safetensors   for nq-streamer --predictor / nq replay --predictor
#   trace.nqrt, expected.json   the torch forward on a held-out slice (the C++ test's reference)
#   train_log.json, log.txt
# About 4 minutes (NQ_JF_SECONDS=150 of training after ~1 minute building the data).
# NQ_JF_HORIZON (default 16, one refresh block: bench/README.md "What a perfect predictor of the
# next H tokens would give"). The same script runs on a CPU with any torch (2.5 minutes here).
#
#   the `run` tool: command "bash scripts/device/train_predictor.sh" (no carry)
#
# Back on the development machine, copy $OUT/jf to bench/predictor/glm5_nano/jf/ and run the
# commands of bench/README.md "Predictor on real routing: glm5_nano".
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.run}/jf"
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
data=bench/predictor/glm5_nano
python3 scripts/predictor/train_jf.py --train "$data"/train.nqrt.gz --eval "$data"/heldout.nqrt.gz \
  --out "$out" --hidden "${NQ_JF_HIDDEN:-16}" --queries "${NQ_JF_QUERIES:-2}" --slots 8 \
  --seconds "${NQ_JF_SECONDS:-150}" --horizon "${NQ_JF_HORIZON:-16}"
ls -la "$out"
