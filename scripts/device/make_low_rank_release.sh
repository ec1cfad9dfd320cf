#!/usr/bin/env bash
# What run_low_rank.sh carries in .lr/ (git-ignored): glm5_nano's release encoded with
# --lowrank_rank 2 (calibrated as scripts/embedded_model.sh calibrates; 36 of its 480 matrices
# are corrected) as release.tar, and the CPU backend's greedy tokens (nq bench-decode, 256 steps
# after a 128-token prompt) at --expert-bits 2 and 4 on it (cpu_lr_*.json) and on the plain
# embedded release (cpu_plain_*.json). The device serves both releases on the GPU and compares.
# Needs build/cpu's nq and the embedded model (scripts/embedded_model.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
nq=${NQ_BIN:-build/cpu/services/tools/nq}
model=.run/embedded
bash scripts/embedded_model.sh "$model" >/dev/null
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$nq" calibrate --model "$model" --tokens models/glm5_nano/calibration.tokens --out "$work/calib" >/dev/null
"$nq" encode --model "$model" --out "$work/release" --calib "$work/calib" --fixed-per-layer 4 --lowrank_rank 2 |
  grep "low-rank" || true
rm -rf .lr && mkdir -p .lr
tar -C "$work/release" -cf .lr/release.tar .
for bits in 2 4; do
  for r in lr plain; do
    release="$work/release"
    [[ $r == plain ]] && release="$model/release"
    "$nq" bench-decode --model="$model" --release="$release" --expert-bits=$bits --backend=cpu --decode-tokens=256 \
      --prompt-tokens=128 --warmup=2 --out=".lr/cpu_${r}_$bits.json" >/dev/null
  done
done
echo "low-rank release and CPU tokens in .lr/"
