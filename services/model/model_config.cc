// ModelConfig's accessors and its config.json writer. Parsing is in model_config_parse.cc,
// validation in model_config_validate.cc, RoPE in rope_config.cc.
#include "services/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <utility>

#include "services/model/model_config_internal.h"

namespace nq::model {

using config_internal::kDeepseekV3Name;
using config_internal::kGlmMoeDsaName;
using Json = nlohmann::json;

absl::string_view ArchitectureName(Architecture architecture) {
  return architecture == Architecture::kGlmMoeDsa ? kGlmMoeDsaName : kDeepseekV3Name;
}

absl::string_view DefaultModelType(Architecture architecture) {
  return architecture == Architecture::kGlmMoeDsa ? "glm_moe_dsa" : "deepseek_v3";
}

int64_t IndexerConfig::SelectionSourceLayer(int64_t layer) const {
  int64_t source = std::min<int64_t>(layer, static_cast<int64_t>(kinds.size()) - 1);
  if (source < layer) return layer;  // past the decoder layers (MTP): its own selection
  while (source > 0 && kinds[source] == IndexerKind::kShared) --source;
  return source;
}

double IndexerConfig::ScoreScale() const { return 1.0 / std::sqrt(static_cast<double>(head_dim)); }
double IndexerConfig::HeadWeightScale() const {
  return 1.0 / std::sqrt(static_cast<double>(n_heads));
}

bool QuantizationConfig::IsNotConverted(absl::string_view module) const {
  if (!modules_to_not_convert.has_value()) return false;
  for (const std::string& listed : *modules_to_not_convert) {
    if (module == listed) return true;
    if (module.size() > listed.size() && module.substr(0, listed.size()) == listed &&
        module[listed.size()] == '.') {
      return true;
    }
  }
  return false;
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (layer < 0) return false;
  // MTP layers follow the decoder layers and are MoE layers in both architectures.
  if (layer >= static_cast<int64_t>(mlp_kinds.size())) {
    return layer < num_hidden_layers + num_nextn_predict_layers;
  }
  return mlp_kinds[layer] == MlpKind::kMoe;
}

int64_t ModelConfig::FirstKDenseReplace() const { return config_internal::LeadingDense(mlp_kinds); }

double ModelConfig::SoftmaxScale() const {
  // Both architectures apply the YaRN mscale correction (transformers 5.17's
  // GlmMoeDsaAttention and DeepseekV3Attention alike; docs/model_math.md section 5.2).
  const double scale = 1.0 / std::sqrt(static_cast<double>(QkHeadDim()));
  return scale * rope.SoftmaxMscaleSquared();
}

std::string ModelConfig::ToJson() const {
  const bool glm = architecture == Architecture::kGlmMoeDsa;
  Json j = Json::object();
  j["architectures"] = Json::array({std::string(ArchitectureName(architecture))});
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["q_lora_rank"] = HasQLora() ? Json(q_lora_rank) : Json(nullptr);
  j["kv_lora_rank"] = kv_lora_rank;
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  j["qk_head_dim"] = QkHeadDim();
  j["head_dim"] = qk_rope_head_dim;  // what both HF config classes set head_dim to
  j["v_head_dim"] = v_head_dim;
  j["attention_bias"] = attention_bias;
  j["n_routed_experts"] = n_routed_experts;
  j["n_shared_experts"] = n_shared_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["n_group"] = n_group;
  j["topk_group"] = topk_group;
  j["routed_scaling_factor"] = routed_scaling_factor;
  j["norm_topk_prob"] = norm_topk_prob;
  j["scoring_func"] = "sigmoid";
  j["topk_method"] = "noaux_tc";
  j["first_k_dense_replace"] = FirstKDenseReplace();
  j["moe_layer_freq"] = 1;
  if (glm) {
    Json kinds = Json::array();
    for (MlpKind kind : mlp_kinds) kinds.push_back(kind == MlpKind::kDense ? "dense" : "sparse");
    j["mlp_layer_types"] = std::move(kinds);
    j["index_topk"] = indexer.topk;
    j["index_head_dim"] = indexer.head_dim;
    j["index_n_heads"] = indexer.n_heads;
    j["indexer_rope_interleave"] = indexer.rope_interleave;
    j["index_share_for_mtp_iteration"] = indexer.share_for_mtp_iteration;
    Json types = Json::array();
    for (IndexerKind kind : indexer.kinds) {
      types.push_back(kind == IndexerKind::kFull ? "full" : "shared");
    }
    j["indexer_types"] = std::move(types);
  }
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = rms_norm_eps;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["bos_token_id"] = bos_token_id.has_value() ? Json(*bos_token_id) : Json(nullptr);
  j["pad_token_id"] = pad_token_id.has_value() ? Json(*pad_token_id) : Json(nullptr);
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids.front();
  } else if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else {
    j["eos_token_id"] = eos_token_ids;
  }

  WriteRopeConfig(rope, j);
  j["rope_interleave"] = rope_interleave;
  j["num_nextn_predict_layers"] = num_nextn_predict_layers;
  if (quantization.has_value() && quantization->method == QuantMethod::kModeloptNvfp4) {
    Json quant = Json::object();
    quant["quant_method"] = "modelopt";
    quant["quant_algo"] = "NVFP4";
    quant["group_size"] = kNvfp4GroupSize;
    if (quantization->modules_to_not_convert.has_value()) {
      quant["exclude_modules"] = *quantization->modules_to_not_convert;
    }
    j["quantization_config"] = std::move(quant);
  } else if (quantization.has_value()) {
    Json quant = Json::object();
    quant["quant_method"] = "fp8";
    quant["fmt"] = quantization->fmt;
    quant["activation_scheme"] = quantization->activation_scheme;
    quant["weight_block_size"] =
        Json::array({quantization->weight_block_rows, quantization->weight_block_cols});
    if (quantization->modules_to_not_convert.has_value()) {
      quant["modules_to_not_convert"] = *quantization->modules_to_not_convert;
    }
    j["quantization_config"] = std::move(quant);
  }
  if (!dtype.empty()) j["dtype"] = dtype;
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace nq::model
