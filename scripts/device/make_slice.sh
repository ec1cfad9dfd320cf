#!/usr/bin/env bash
# A model slice at a real model's layer shapes, to serve and time where the real checkpoint cannot
# go (issues #13, #14): random BF16 weights for everything but the routed experts (nq synth-model
# --routed_experts=false), and a NestQuant release of made-up experts at the real sizes (nq
# synth-release: one encoded template per projection, random codes per expert; seconds where
# nq encode of a GLM-5 MoE layer's 9.7B weights would take hours). In DIR and DIR/release.
#   glm5: GLM-5's layer shapes exactly (hidden 6144, 64 MLA heads, q/kv LoRA 2048/512, DSA indexer
#         32 x 128 keeping 2048, dense MLP 12288, experts 2048 wide, 8 routed + 1 shared) with
#         glm5_nano's 8192-token vocabulary and tokenizer, so the router can serve it.
#   dsv3: DeepSeek-V3's config (hidden 7168, dense 18432, 128 heads, q/kv LoRA 1536/512, experts
#         2048 wide, top-8 + 1 shared, vocabulary 129280) with n_group 1: the peer benchmark's
#         slice (issue #13) at 4 layers and 32 experts. No tokenizer: nq bench-decode draws ids.
# Cut to LAYERS layers (the first dense) with EXPERTS routed experts per MoE layer and MTP MTP
# layers (default 0, as most checkpoints ship; 1 adds the MTP layer at the same shapes).
# NQ_MAX_POSITIONS sets the slice's max_position_embeddings (default 16384; long-prompt runs
# raise it: GLM-5's own is 202752).
#
#   NQ=path/to/nq bash scripts/device/make_slice.sh glm5|dsv3 DIR [LAYERS=3] [EXPERTS=32] [MTP=0]
set -euo pipefail
cd "$(dirname "$0")/../.."
arch="$1"
dir="$2"
layers="${3:-3}"
experts="${4:-32}"
mtp="${5:-0}"
nq="${NQ:-build/cpu/services/tools/nq}"
case "$arch" in
  glm5) source_config=tests/model_config/data/glm5/config.json ;;
  dsv3) source_config=tests/model_config/data/deepseek_v3/config.json ;;
  *) echo "make_slice.sh: unknown architecture '$arch' (glm5 or dsv3)" >&2; exit 2 ;;
esac
mkdir -p "$dir"
python3 - "$source_config" "$dir/config.json" "$arch" "$layers" "$experts" "$mtp" "${NQ_MAX_POSITIONS:-16384}" <<'PY'
import json, sys
src, out, arch = sys.argv[1], sys.argv[2], sys.argv[3]
layers, experts, mtp, positions = (int(a) for a in sys.argv[4:8])
config = json.load(open(src))
config.update({
    "num_hidden_layers": layers, "first_k_dense_replace": 1, "n_routed_experts": experts,
    "num_nextn_predict_layers": mtp, "max_position_embeddings": positions,
    "_comment": f"{arch}'s layer shapes, {layers} layers + {mtp} MTP, {experts} routed experts "
                "(scripts/device/make_slice.sh)",
})
if arch == "glm5":
    config.update({"vocab_size": 8192, "eos_token_id": [0, 7, 9], "pad_token_id": 0})
else:
    config.update({"n_group": 1, "topk_group": 1})
json.dump(config, open(out, "w"), indent=2)
PY
if [[ "$arch" == glm5 ]]; then
  cp models/glm5_nano/tokenizer.json models/glm5_nano/tokenizer_config.json models/glm5_nano/generation_config.json "$dir/"
fi
start=$SECONDS
"$nq" synth-model --config "$dir/config.json" --out "$dir" --dtype bf16 --seed 5 --max_shard_mb 4096 --routed_experts=false
echo "synth-model: $((SECONDS - start)) s, $(du -sh "$dir" | cut -f1)"
start=$SECONDS
"$nq" synth-release --model "$dir" --out "$dir/release" --fixed-per-layer 4 --seed 5
echo "synth-release: $((SECONDS - start)) s, release $(du -sh "$dir/release" | cut -f1)"
