#!/usr/bin/env bash
# Prepares the embedded default model in DIR (default .run/embedded) unless it is there:
# glm5_nano (models/glm5_nano: a GlmMoeDsaForCausalLM of 18.8M parameters trained on Python
# sources, with its own byte-level BPE tokenizer; scripts/train/README.md), and its NestQuant
# release in DIR/release, the record directory the streamer serves. Needs a built `nq`
# (build/cpu, or $NQ_BIN).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.run/embedded}
nq=${NQ_BIN:-build/cpu/services/tools/nq}
readonly src=models/glm5_nano
readonly files=(config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json)
mkdir -p "$dir"
# Several processes (parallel tests) may prepare the same directory: one at a time.
exec 9>"$dir/.lock"
flock 9
# A model that changed (a new commit of models/glm5_nano) invalidates its release.
for f in "${files[@]}"; do
  if ! cmp -s "$src/$f" "$dir/$f"; then
    rm -rf "$dir/release"
    cp "$src/$f" "$dir/$f.tmp"
    mv "$dir/$f.tmp" "$dir/$f"
  fi
done
# A release this build cannot serve (an older format version: its manifest names the version, and
# `nq verify` refuses it) is encoded again.
if [[ -f "$dir/release/COMPLETE" ]] && ! "$nq" verify "$dir/release" >/dev/null 2>&1; then
  echo "re-encoding $dir/release: $("$nq" verify "$dir/release" 2>&1 | tail -n 1)"
  rm -rf "$dir/release"
fi
# Calibrated on 8k tokens of training-split stdlib text (models/glm5_nano/calibration.tokens,
# scripts/train/calibration_text.py): per-expert Hessians for LDLQ and the routing counts that
# rank the experts; the four most routed of each layer's 32 are the fixed 4-bit set. nq encode
# resumes an interrupted run and writes COMPLETE last.
if [[ ! -f "$dir/release/COMPLETE" ]]; then
  "$nq" calibrate --model "$dir" --tokens "$src/calibration.tokens" --out "$dir/calibration.tmp" >/dev/null
  # NQ_ENCODE_ARGS: extra nq encode flags for a measurement's own directory (bench/quality), e.g.
  # "--codebook_refinements 0"; the embedded default leaves it unset.
  read -r -a extra <<<"${NQ_ENCODE_ARGS:-}"
  "$nq" encode --model "$dir" --out "$dir/release" --calib "$dir/calibration.tmp" --fixed-per-layer 4 \
    "${extra[@]}" >/dev/null
  rm -f "$dir/calibration.tmp"
  echo "release ready in $dir/release"
fi
