#!/usr/bin/env bash
# On the device: sampled requests with MTP drafts, the backend's path (greedy drafts chained on the
# GPU, each verification row drawn there) against the host's (sampled drafts and rejection
# sampling over logits brought to the host), through `nq bench-decode --speculative_tokens`, on a
# DeepSeek-V3-shaped slice with its 129280-token vocabulary and an MTP layer (make_slice.sh, built
# on the device: synth-model and synth-release). Results in $OUT (bench_*.json, slice.txt); one
# line a run on stdout.
#
# Here (nq and its libraries, xz-compressed: ICU's data alone is 30 MB; .devspec/ and .device3/ in
# .git/info/exclude):
#   cmake --build build/cuda --target nq && mkdir -p .device3/bin .devspec
#   strip -o .device3/bin/nq build/cuda/services/tools/nq
#   source scripts/device/shared_libs.sh && copy_shared_libs .device3/lib .device3/bin/nq
#   tar -C .device3 -cf - bin lib | xz -T0 -9 > .devspec/bundle.tar.xz
#   bash scripts/device/slim_tree.sh on cluster
# the `run` tool: carry [".devspec"], command: bash scripts/device/run_sampled_spec.sh
# Building the slice takes most of the call: synth-model wrote the 2-layer slice (9.1 GB with the
# MTP layer and two 129280-row matrices) in 197 s on an H100 machine (2026-12-06), synth-release
# 12 s; give the call 5 minutes or more after the machine starts.
# NQ_LAYERS (2: the dense layer and one MoE layer), NQ_DECODE_TOKENS (96),
# NQ_RUNS ("3:true 3:false 0:true": speculative tokens : device sampling, in that order).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/out}"
mkdir -p "$out"
bundle=/tmp/nq-devspec
mkdir -p "$bundle" && xz -dc .devspec/bundle.tar.xz | tar -C "$bundle" -xf - || exit 1
export LD_LIBRARY_PATH="$bundle/lib:$(bash scripts/device/cuda_wheel_libs.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nq="$bundle/bin/nq"
slice=/tmp/nq-dsv3-mtp-slice
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
if ! NQ="$nq" bash scripts/device/make_slice.sh dsv3 "$slice" "${NQ_LAYERS:-2}" 32 1 >"$out/slice.txt" 2>&1; then
  tail -5 "$out/slice.txt"
  exit 1
fi
echo "slice built in $(($(date +%s) - start)) s"
status=0
for run in ${NQ_RUNS:-3:true 3:false 0:true}; do
  drafts="${run%%:*}" device="${run##*:}"
  timeout 150 "$nq" bench-decode --model "$slice" --release "$slice/release" --expert-bits 2 --backend cuda --weight_dtype bf16 \
    --prompt-tokens 32 --warmup 8 --decode-tokens "${NQ_DECODE_TOKENS:-96}" --seed 7 --sampling_temperature 0.8 \
    --speculative_tokens "$drafts" --device_sampling="$device" --out "$out/bench_${drafts}_${device}.json" \
    >"$out/bench_${drafts}_${device}.txt" 2>&1 || status=1
  echo "== drafts $drafts, device sampling $device:"
  grep -E "tokens/s" "$out/bench_${drafts}_${device}.txt" | tail -1
done
exit "$status"
