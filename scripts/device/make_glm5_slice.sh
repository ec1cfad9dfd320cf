#!/usr/bin/env bash
# A GLM-5-shaped slice to serve where the real checkpoint cannot go (issue #14): GLM-5's layer
# shapes exactly (hidden 6144, 64 MLA heads, q/kv LoRA 2048/512, DSA indexer 32 x 128 keeping
# 2048, dense MLP 12288, experts 2048 wide, 8 routed + 1 shared), cut to LAYERS layers (the
# first dense) with EXPERTS routed experts per MoE layer, MTP MTP layers (default 0: as most
# checkpoints ship; 1 adds GLM-5's MTP layer at the same shapes), and glm5_nano's 8192-token
# vocabulary so the router has a tokenizer for it. Random BF16 weights (nq synth-model), then its
# NestQuant release (nq encode, no calibration: the codec's own scales), in DIR and DIR/release.
#
#   NQ=path/to/nq bash scripts/device/make_glm5_slice.sh DIR [LAYERS=3] [EXPERTS=32] [MTP=0]
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="$1"
layers="${2:-3}"
experts="${3:-32}"
mtp="${4:-0}"
nq="${NQ:-build/cpu/services/tools/nq}"
mkdir -p "$dir"
python3 - "$dir/config.json" "$layers" "$experts" "$mtp" <<'PY'
import json, sys
out, layers, experts, mtp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
config = json.load(open("tests/model_config/data/glm5/config.json"))
config.update({
    "num_hidden_layers": layers, "first_k_dense_replace": 1, "n_routed_experts": experts,
    "num_nextn_predict_layers": mtp, "vocab_size": 8192, "eos_token_id": [0, 7, 9], "pad_token_id": 0,
    "max_position_embeddings": 16384,
    "_comment": f"GLM-5's layer shapes, {layers} layers + {mtp} MTP, {experts} routed experts, glm5_nano's vocabulary "
                "(scripts/device/make_glm5_slice.sh)",
})
json.dump(config, open(out, "w"), indent=2)
PY
cp models/glm5_nano/tokenizer.json models/glm5_nano/tokenizer_config.json models/glm5_nano/generation_config.json "$dir/"
start=$SECONDS
"$nq" synth-model --config "$dir/config.json" --out "$dir" --dtype bf16 --seed 5 --max_shard_mb 4096
echo "synth-model: $((SECONDS - start)) s, $(du -sh "$dir" | cut -f1)"
start=$SECONDS
"$nq" encode --model "$dir" --out "$dir/release" --fixed-per-layer 4
echo "encode: $((SECONDS - start)) s, release $(du -sh "$dir/release" | cut -f1)"
