// ModelConfig::Validate: the rules a config must keep to be served (sizes in range, MLA and
// routing shapes consistent, token ids in the vocabulary, RoPE, the indexer, FP8 settings).
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/model_config.h"
#include "services/model/model_config_internal.h"

namespace nq::model {
namespace {

using config_internal::CheckRange;
using config_internal::DenseThenMoe;
using config_internal::Invalid;
using config_internal::kDeepseekV3Name;
using config_internal::kGlmMoeDsaName;
using config_internal::kMaxLayers;
using config_internal::kMaxSize;
using config_internal::Unimplemented;

absl::Status CheckPositive(const char* name, double value) {
  if (!(value > 0.0) || !std::isfinite(value)) {
    return Invalid(name, " must be a finite number > 0, got ", value);
  }
  return absl::OkStatus();
}

absl::Status ValidateIndexer(const ModelConfig& config) {
  const IndexerConfig& indexer = config.indexer;
  if (config.architecture == Architecture::kDeepseekV3) {
    if (indexer.enabled || !indexer.kinds.empty()) {
      return Invalid(kDeepseekV3Name, " has no DSA indexer");
    }
    return absl::OkStatus();
  }
  if (!indexer.enabled) return Invalid(kGlmMoeDsaName, " needs its DSA indexer enabled");
  if (indexer.topk <= 0) return Invalid("index_topk must be > 0, got ", indexer.topk);
  RETURN_IF_ERROR(CheckRange("index_n_heads", indexer.n_heads, 1, kMaxSize));
  // The indexer's q and k carry RoPE on their first qk_rope_head_dim dims.
  RETURN_IF_ERROR(
      CheckRange("index_head_dim", indexer.head_dim, config.qk_rope_head_dim, kMaxSize));
  if (static_cast<int64_t>(indexer.kinds.size()) != config.num_hidden_layers) {
    return Invalid("indexer_types has ", indexer.kinds.size(), " entries but num_hidden_layers is ",
                   config.num_hidden_layers);
  }
  if (indexer.kinds.front() != IndexerKind::kFull) {
    return Invalid("indexer_types[0] is \"shared\" but no earlier layer runs the indexer");
  }
  return absl::OkStatus();
}

absl::Status ValidateQuantization(const QuantizationConfig& quant) {
  if (quant.fmt != "e4m3") return Unimplemented("quantization_config.fmt \"", quant.fmt, "\"");
  if (quant.activation_scheme != "dynamic") {
    return Unimplemented("quantization_config.activation_scheme \"", quant.activation_scheme, "\"");
  }
  if (quant.weight_block_rows <= 0 || quant.weight_block_cols <= 0) {
    return Invalid("quantization_config.weight_block_size must be positive, got [",
                   quant.weight_block_rows, ", ", quant.weight_block_cols, "]");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelConfig::Validate() const {
  if (model_type.empty()) return Invalid("model_type is empty");
  RETURN_IF_ERROR(CheckRange("num_hidden_layers", num_hidden_layers, 1, kMaxLayers));
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"moe_intermediate_size", moe_intermediate_size},
      {"num_attention_heads", num_attention_heads},
      {"kv_lora_rank", kv_lora_rank},
      {"qk_nope_head_dim", qk_nope_head_dim},
      {"qk_rope_head_dim", qk_rope_head_dim},
      {"v_head_dim", v_head_dim},
      {"n_routed_experts", n_routed_experts},
      {"num_experts_per_tok", num_experts_per_tok},
      {"n_group", n_group},
      {"topk_group", topk_group},
      {"max_position_embeddings", max_position_embeddings},
  };
  for (const auto& [name, value] : sizes) RETURN_IF_ERROR(CheckRange(name, value, 1, kMaxSize));
  RETURN_IF_ERROR(CheckRange("q_lora_rank", q_lora_rank, 0, kMaxSize));
  RETURN_IF_ERROR(CheckRange("n_shared_experts", n_shared_experts, 0, kMaxSize));
  RETURN_IF_ERROR(CheckRange("num_nextn_predict_layers", num_nextn_predict_layers, 0, kMaxLayers));
  if (qk_rope_head_dim % 2 != 0) {
    return Invalid("qk_rope_head_dim ", qk_rope_head_dim, " must be even (RoPE rotates pairs)");
  }
  if (num_key_value_heads != num_attention_heads) {
    return Invalid("num_key_value_heads ", num_key_value_heads, " != num_attention_heads ",
                   num_attention_heads, ": MLA expands keys and values for every head");
  }

  if (num_experts_per_tok > n_routed_experts) {
    return Invalid("num_experts_per_tok ", num_experts_per_tok, " exceeds n_routed_experts ",
                   n_routed_experts);
  }
  if (n_routed_experts % n_group != 0) {
    return Invalid("n_routed_experts ", n_routed_experts, " is not divisible by n_group ", n_group);
  }
  if (topk_group > n_group) {
    return Invalid("topk_group ", topk_group, " exceeds n_group ", n_group);
  }
  const int64_t experts_per_group = n_routed_experts / n_group;
  if (experts_per_group < 2) {
    // noaux_tc scores a group by the sum of its two best experts.
    return Invalid("n_routed_experts / n_group = ", experts_per_group,
                   " but noaux_tc routing needs at least 2 experts per group");
  }
  if (num_experts_per_tok > topk_group * experts_per_group) {
    return Invalid("num_experts_per_tok ", num_experts_per_tok, " exceeds the ",
                   topk_group * experts_per_group, " experts in topk_group ", topk_group,
                   " groups");
  }
  RETURN_IF_ERROR(CheckPositive("routed_scaling_factor", routed_scaling_factor));
  RETURN_IF_ERROR(CheckPositive("rms_norm_eps", rms_norm_eps));
  if (static_cast<int64_t>(mlp_kinds.size()) != num_hidden_layers) {
    return Invalid("mlp layer kinds has ", mlp_kinds.size(), " entries but num_hidden_layers is ",
                   num_hidden_layers);
  }
  if (architecture == Architecture::kDeepseekV3 &&
      mlp_kinds != DenseThenMoe(num_hidden_layers, FirstKDenseReplace())) {
    return Invalid(kDeepseekV3Name, " layers must be dense first, then MoE");
  }

  std::vector<std::pair<const char*, int64_t>> token_ids;
  if (bos_token_id.has_value()) token_ids.emplace_back("bos_token_id", *bos_token_id);
  if (pad_token_id.has_value()) token_ids.emplace_back("pad_token_id", *pad_token_id);
  for (int64_t id : eos_token_ids) token_ids.emplace_back("eos_token_id", id);
  for (const auto& [name, id] : token_ids) {
    if (id < 0 || id >= vocab_size) {
      return Invalid(name, " ", id, " is outside the vocabulary [0, ", vocab_size, ")");
    }
  }

  RETURN_IF_ERROR(rope.Validate());
  RETURN_IF_ERROR(ValidateIndexer(*this));
  if (quantization.has_value()) RETURN_IF_ERROR(ValidateQuantization(*quantization));
  if (!dtype.empty() && dtype != "bfloat16" && dtype != "float16" && dtype != "float32") {
    return Unimplemented("dtype \"", dtype,
                         "\" is not supported; supported: bfloat16, "
                         "float16, float32");
  }
  return absl::OkStatus();
}

}  // namespace nq::model
