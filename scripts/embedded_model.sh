#!/usr/bin/env bash
# Writes the embedded default model into DIR (default .run/embedded) unless it is there:
# a GLM-5-shaped tiny model with random bf16 weights (nq synth-model, configs/embedded/) and
# the DeepSeek-V3 tokenizer.json, so text round-trips, and its NestQuant release in
# DIR/release. Needs a built `nq` (build/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.run/embedded}
nq=${NQ_BIN:-build/cpu/services/tools/nq}
if ! [[ -f "$dir/config.json" && -f "$dir/tokenizer.json" && ( -f "$dir/model.safetensors" || -f "$dir/model.safetensors.index.json" ) ]]; then
  mkdir -p "$dir"
  "$nq" synth-model --config configs/embedded/glm5_tiny.json --out "$dir" --dtype bf16 --seed 0
  gunzip -c tests/tokenizer/data/deepseek_v3.tokenizer.json.gz > "$dir/tokenizer.json.tmp"
  mv "$dir/tokenizer.json.tmp" "$dir/tokenizer.json"
  echo "embedded model ready in $dir"
fi
# Its NestQuant release (2-bit base + streamed residuals), the record directory the streamer
# serves. nq encode resumes an interrupted run and writes COMPLETE last.
if [[ ! -f "$dir/release/COMPLETE" ]]; then
  "$nq" encode --model "$dir" --out "$dir/release" --fixed-per-layer 2 >/dev/null
  echo "release ready in $dir/release"
fi
