#include "services/model/tensor_manifest.h"

#include "absl/strings/str_cat.h"

namespace nq::model {
namespace {

using Init = ExpectedTensor::Init;

void AddLinear(std::vector<ExpectedTensor>& out, std::string name, int64_t rows, int64_t cols,
               bool fp8 = true) {
  out.push_back({std::move(name), {rows, cols}, fp8, Init::kLinear});
}

void AddNorm(std::vector<ExpectedTensor>& out, std::string name, int64_t d) {
  out.push_back({std::move(name), {d}, false, Init::kNormWeight});
}

void AddMlp(std::vector<ExpectedTensor>& out, const std::string& prefix, int64_t hidden,
            int64_t intermediate) {
  AddLinear(out, prefix + "gate_proj.weight", intermediate, hidden);
  AddLinear(out, prefix + "up_proj.weight", intermediate, hidden);
  AddLinear(out, prefix + "down_proj.weight", hidden, intermediate);
}

void AddAttention(std::vector<ExpectedTensor>& out, const ModelConfig& c, const std::string& p,
                  bool with_indexer) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads;
  if (c.HasQLora()) {
    AddLinear(out, p + "self_attn.q_a_proj.weight", c.q_lora_rank, D);
    AddNorm(out, p + "self_attn.q_a_layernorm.weight", c.q_lora_rank);
    AddLinear(out, p + "self_attn.q_b_proj.weight", H * c.QkHeadDim(), c.q_lora_rank);
  } else {
    AddLinear(out, p + "self_attn.q_proj.weight", H * c.QkHeadDim(), D);
  }
  AddLinear(out, p + "self_attn.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, D);
  AddNorm(out, p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank);
  AddLinear(out, p + "self_attn.kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank);
  AddLinear(out, p + "self_attn.o_proj.weight", D, H * c.v_head_dim);
  if (with_indexer) {
    const IndexerConfig& ix = c.indexer;
    const std::string q = p + "self_attn.indexer.";
    AddLinear(out, q + "wq_b.weight", ix.n_heads * ix.head_dim, c.q_lora_rank);
    AddLinear(out, q + "wk.weight", ix.head_dim, D);
    AddNorm(out, q + "k_norm.weight", ix.head_dim);
    out.push_back({q + "k_norm.bias", {ix.head_dim}, false, Init::kZero});
    // The per-head weights feed a ReLU-weighted sum; hub FP8 checkpoints keep them in bf16.
    AddLinear(out, q + "weights_proj.weight", ix.n_heads, D, /*fp8=*/false);
  }
}

void AddMoe(std::vector<ExpectedTensor>& out, const ModelConfig& c, const std::string& p) {
  const int64_t D = c.hidden_size;
  // The router stays in full precision in every hub checkpoint.
  AddLinear(out, p + "mlp.gate.weight", c.n_routed_experts, D, /*fp8=*/false);
  out.push_back({p + "mlp.gate.e_score_correction_bias", {c.n_routed_experts}, false, Init::kZero});
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    AddMlp(out, absl::StrCat(p, "mlp.experts.", e, "."), D, c.moe_intermediate_size);
  }
  if (c.n_shared_experts > 0) {
    AddMlp(out, p + "mlp.shared_experts.", D, c.moe_intermediate_size * c.n_shared_experts);
  }
}

}  // namespace

std::string LayerPrefix(int64_t layer) { return absl::StrCat("model.layers.", layer, "."); }

std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& c) {
  std::vector<ExpectedTensor> out;
  const int64_t D = c.hidden_size;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, D}, false, Init::kEmbedding});
  const int64_t total_layers = c.num_hidden_layers + c.num_nextn_predict_layers;
  for (int64_t layer = 0; layer < total_layers; ++layer) {
    const std::string p = LayerPrefix(layer);
    const bool mtp = layer >= c.num_hidden_layers;
    if (mtp) {
      AddNorm(out, p + "enorm.weight", D);
      AddNorm(out, p + "hnorm.weight", D);
      // Hub MTP layers carry a copy of the embedding; the graph uses model.embed_tokens.
      out.push_back({p + "embed_tokens.weight", {c.vocab_size, D}, false, Init::kEmbedding});
      AddLinear(out, p + "eh_proj.weight", D, 2 * D, /*fp8=*/false);
      AddNorm(out, p + "shared_head.norm.weight", D);
      AddLinear(out, p + "shared_head.head.weight", c.vocab_size, D, /*fp8=*/false);
    }
    AddNorm(out, p + "input_layernorm.weight", D);
    AddNorm(out, p + "post_attention_layernorm.weight", D);
    // An MTP layer runs its own indexer (it attends over its own cache).
    const bool indexer = c.indexer.enabled &&
                         (mtp || c.indexer.kinds[layer] == IndexerKind::kFull);
    AddAttention(out, c, p, indexer);
    if (c.IsMoeLayer(layer)) {
      AddMoe(out, c, p);
    } else {
      AddMlp(out, p + "mlp.", D, c.intermediate_size);
    }
  }
  AddNorm(out, "model.norm.weight", D);
  if (!c.tie_word_embeddings) AddLinear(out, "lm_head.weight", c.vocab_size, D, /*fp8=*/false);
  return out;
}

}  // namespace nq::model
