// config.json -> ModelConfig: the keys of both architectures, the HF config classes'
// defaults, the layer-kind and indexer schedules, quantization_config. ModelConfig::Validate
// (model_config_validate.cc) then checks the values.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/model/config_fields.h"
#include "services/model/model_config.h"
#include "services/model/model_config_internal.h"

namespace nq::model {
namespace {

using config_internal::CheckRange;
using config_internal::DenseThenMoe;
using config_internal::Fields;
using config_internal::Invalid;
using config_internal::Json;
using config_internal::kDeepseekV3Name;
using config_internal::kGlmMoeDsaName;
using config_internal::kMaxLayers;
using config_internal::LeadingDense;
using config_internal::ParseJsonObject;
using config_internal::Unimplemented;

// A config.json is a few KiB (GLM-5-FP8's, with its modules_to_not_convert list, tens of KiB).
constexpr size_t kMaxConfigBytes = size_t{16} << 20;

// Defaults of the HF config classes that differ between the two architectures.
struct ArchitectureDefaults {
  int64_t n_group;
  int64_t topk_group;
  int64_t max_position_embeddings;
  double rms_norm_eps;
};
constexpr ArchitectureDefaults kDeepseekV3Defaults{8, 4, 4096, 1e-6};   // DeepseekV3Config
constexpr ArchitectureDefaults kGlmMoeDsaDefaults{1, 1, 202752, 1e-5};  // GlmMoeDsaConfig

// Defaults the two HF classes share.
constexpr int64_t kDefaultNSharedExperts = 1;
constexpr double kDefaultRoutedScalingFactor = 2.5;
constexpr int64_t kDefaultFirstKDenseReplace = 3;
constexpr int64_t kDefaultBosTokenId = 0;
constexpr int64_t kDefaultEosTokenId = 1;
// GlmMoeDsaConfig defaults for the DSA indexer.
constexpr int64_t kDefaultIndexTopk = 2048;
constexpr int64_t kDefaultIndexHeadDim = 128;
constexpr int64_t kDefaultIndexNHeads = 32;
// GlmMoeDsaConfig.__post_init__ derives indexer_types from these when the list is absent.
constexpr int64_t kDefaultIndexTopkFreq = 1;
constexpr int64_t kDefaultIndexSkipTopkOffset = 2;

absl::StatusOr<Architecture> ParseArchitecture(const Fields& fields) {
  ASSIGN_OR_RETURN(std::vector<std::string> names, fields.StringList("architectures"));
  // Like vLLM, take the first architecture we serve.
  for (const std::string& name : names) {
    if (name == kGlmMoeDsaName) return Architecture::kGlmMoeDsa;
    if (name == kDeepseekV3Name) return Architecture::kDeepseekV3;
  }
  return Unimplemented("unsupported architecture [", absl::StrJoin(names, ", "),
                       "]; supported: ", kGlmMoeDsaName, ", ", kDeepseekV3Name);
}

// One of `allowed` (a value we implement), else UNIMPLEMENTED listing them.
absl::Status CheckSupported(const Fields& fields, const char* key, const std::string& value,
                            std::initializer_list<const char*> allowed) {
  for (const char* candidate : allowed) {
    if (value == candidate) return absl::OkStatus();
  }
  return Unimplemented(fields.Name(key), " \"", value,
                       "\" is not supported; supported: ", absl::StrJoin(allowed, ", "));
}

// mlp_layer_types / first_k_dense_replace / moe_layer_freq -> one kind per layer.
absl::Status ParseMlpKinds(const Fields& fields, ModelConfig& config) {
  ASSIGN_OR_RETURN(int64_t moe_layer_freq, fields.Int("moe_layer_freq", 1));
  if (moe_layer_freq != 1) {
    return Unimplemented("moe_layer_freq ", moe_layer_freq,
                         " is not supported (DeepSeek-V3 and GLM-5 use 1: every layer past "
                         "first_k_dense_replace is MoE)");
  }
  ASSIGN_OR_RETURN(int64_t first_k,
                   fields.Int("first_k_dense_replace", kDefaultFirstKDenseReplace));
  if (first_k < 0 || first_k > config.num_hidden_layers) {
    return Invalid("first_k_dense_replace ", first_k,
                   " is outside [0, num_hidden_layers = ", config.num_hidden_layers, "]");
  }
  std::vector<MlpKind> derived = DenseThenMoe(config.num_hidden_layers, first_k);
  if (!fields.HasNonNull("mlp_layer_types")) {
    config.mlp_kinds = std::move(derived);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<std::string> names, fields.StringList("mlp_layer_types"));
  if (static_cast<int64_t>(names.size()) != config.num_hidden_layers) {
    return Invalid("mlp_layer_types has ", names.size(), " entries but num_hidden_layers is ",
                   config.num_hidden_layers);
  }
  std::vector<MlpKind> kinds;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == "dense") {
      kinds.push_back(MlpKind::kDense);
    } else if (names[i] == "sparse") {
      kinds.push_back(MlpKind::kMoe);
    } else {
      return Invalid("mlp_layer_types[", i, "] is \"", names[i], "\"; expected dense or sparse");
    }
  }
  if (config.architecture == Architecture::kDeepseekV3 && kinds != derived) {
    // HF DeepseekV3 builds its layers from first_k_dense_replace alone.
    return Invalid("mlp_layer_types disagrees with first_k_dense_replace ", first_k,
                   ", which is what DeepseekV3ForCausalLM follows");
  }
  if (fields.Has("first_k_dense_replace") && LeadingDense(kinds) != first_k) {
    return Invalid("mlp_layer_types starts with ", LeadingDense(kinds),
                   " dense layers but first_k_dense_replace is ", first_k);
  }
  config.mlp_kinds = std::move(kinds);
  return absl::OkStatus();
}

absl::StatusOr<IndexerKind> IndexerKindFromName(absl::string_view name, size_t layer) {
  if (name == "full") return IndexerKind::kFull;
  if (name == "shared") return IndexerKind::kShared;
  return Invalid("indexer type of layer ", layer, " is \"", name, "\"; expected full or shared");
}

// GlmMoeDsaConfig.__post_init__: indexer_types, else index_topk_pattern ("FSS..." or a
// list), else the index_topk_freq / index_skip_topk_offset schedule.
absl::StatusOr<std::vector<IndexerKind>> ParseIndexerKinds(const Fields& fields,
                                                           int64_t num_layers) {
  std::vector<std::string> names;
  const Json* pattern = fields.Find("index_topk_pattern");
  if (fields.HasNonNull("indexer_types")) {
    ASSIGN_OR_RETURN(names, fields.StringList("indexer_types"));
  } else if (pattern != nullptr && pattern->is_string()) {
    for (char c : pattern->get<std::string>()) {
      if (c != 'F' && c != 'S') {
        return Invalid("index_topk_pattern holds '", std::string(1, c), "'; expected F or S");
      }
      names.push_back(c == 'F' ? "full" : "shared");
    }
  } else if (pattern != nullptr && !pattern->is_null()) {
    ASSIGN_OR_RETURN(names, fields.StringList("index_topk_pattern"));
  } else {
    ASSIGN_OR_RETURN(int64_t freq, fields.Int("index_topk_freq", kDefaultIndexTopkFreq));
    ASSIGN_OR_RETURN(int64_t offset,
                     fields.Int("index_skip_topk_offset", kDefaultIndexSkipTopkOffset));
    RETURN_IF_ERROR(CheckRange("index_skip_topk_offset", offset, -kMaxLayers, kMaxLayers));
    freq = std::max<int64_t>(freq, 1);  // HF: max(index_topk_freq, 1)
    std::vector<IndexerKind> kinds;
    for (int64_t i = 0; i < num_layers; ++i) {
      const bool full = std::max<int64_t>(i - offset + 1, 0) % freq == 0;
      kinds.push_back(full ? IndexerKind::kFull : IndexerKind::kShared);
    }
    return kinds;
  }
  if (static_cast<int64_t>(names.size()) != num_layers) {
    return Invalid("indexer_types has ", names.size(), " entries but num_hidden_layers is ",
                   num_layers);
  }
  std::vector<IndexerKind> kinds;
  for (size_t i = 0; i < names.size(); ++i) {
    ASSIGN_OR_RETURN(IndexerKind kind, IndexerKindFromName(names[i], i));
    kinds.push_back(kind);
  }
  return kinds;
}

constexpr const char* kIndexerKeys[] = {"index_topk", "index_head_dim", "index_n_heads",
                                        "indexer_types"};

absl::Status ParseIndexer(const Fields& fields, ModelConfig& config) {
  IndexerConfig& indexer = config.indexer;
  if (config.architecture == Architecture::kDeepseekV3) {
    for (const char* key : kIndexerKeys) {
      if (fields.HasNonNull(key)) {
        return Invalid("the config sets ", key, " but ", kDeepseekV3Name,
                       " has no DSA indexer (DeepSeek-V3.2 checkpoints declare "
                       "DeepseekV32ForCausalLM, which is not supported)");
      }
    }
    return absl::OkStatus();
  }
  indexer.enabled = true;
  ASSIGN_OR_RETURN(indexer.topk, fields.Int("index_topk", kDefaultIndexTopk));
  ASSIGN_OR_RETURN(indexer.head_dim, fields.Int("index_head_dim", kDefaultIndexHeadDim));
  ASSIGN_OR_RETURN(indexer.n_heads, fields.Int("index_n_heads", kDefaultIndexNHeads));
  ASSIGN_OR_RETURN(indexer.rope_interleave, fields.Bool("indexer_rope_interleave", false));
  ASSIGN_OR_RETURN(indexer.share_for_mtp_iteration,
                   fields.Bool("index_share_for_mtp_iteration", false));
  ASSIGN_OR_RETURN(indexer.kinds, ParseIndexerKinds(fields, config.num_hidden_layers));
  return absl::OkStatus();
}

absl::StatusOr<std::optional<QuantizationConfig>> ParseQuantization(const Fields& root) {
  ASSIGN_OR_RETURN(const Json* object, root.Object("quantization_config"));
  if (object == nullptr) return std::optional<QuantizationConfig>();
  const Fields fields(*object, "quantization_config");
  QuantizationConfig quant;
  if (!fields.Has("quant_method")) return fields.Missing("quant_method");
  ASSIGN_OR_RETURN(std::string method, fields.String("quant_method", ""));
  RETURN_IF_ERROR(CheckSupported(fields, "quant_method", method, {"fp8", "modelopt"}));
  if (method == "modelopt") {
    quant.method = QuantMethod::kModeloptNvfp4;
    if (!fields.Has("quant_algo")) return fields.Missing("quant_algo");
    ASSIGN_OR_RETURN(std::string algo, fields.String("quant_algo", ""));
    RETURN_IF_ERROR(CheckSupported(fields, "quant_algo", algo, {"NVFP4"}));
    // NVFP4 is defined with 16-element blocks; another group size is another format.
    ASSIGN_OR_RETURN(int64_t group_size, fields.Int("group_size", kNvfp4GroupSize));
    if (group_size != kNvfp4GroupSize) {
      return Unimplemented(fields.Name("group_size"), " ", group_size, " is not supported; NVFP4 blocks are ",
                           kNvfp4GroupSize);
    }
    if (fields.HasNonNull("exclude_modules")) {
      ASSIGN_OR_RETURN(quant.modules_to_not_convert, fields.StringList("exclude_modules"));
    }
    return std::optional<QuantizationConfig>(std::move(quant));
  }
  ASSIGN_OR_RETURN(quant.fmt, fields.String("fmt", quant.fmt));
  RETURN_IF_ERROR(CheckSupported(fields, "fmt", quant.fmt, {"e4m3"}));
  ASSIGN_OR_RETURN(quant.activation_scheme,
                   fields.String("activation_scheme", quant.activation_scheme));
  RETURN_IF_ERROR(
      CheckSupported(fields, "activation_scheme", quant.activation_scheme, {"dynamic"}));
  if (const Json* block = fields.Find("weight_block_size"); block != nullptr) {
    if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
        !(*block)[1].is_number_integer()) {
      return fields.WrongType("weight_block_size", "an array of two integers", *block);
    }
    ASSIGN_OR_RETURN(quant.weight_block_rows, fields.AsInt("weight_block_size", (*block)[0]));
    ASSIGN_OR_RETURN(quant.weight_block_cols, fields.AsInt("weight_block_size", (*block)[1]));
  }
  if (fields.HasNonNull("modules_to_not_convert")) {
    ASSIGN_OR_RETURN(quant.modules_to_not_convert, fields.StringList("modules_to_not_convert"));
  }
  return std::optional<QuantizationConfig>(std::move(quant));
}

absl::Status ParseTokens(const Fields& fields, ModelConfig& config) {
  ASSIGN_OR_RETURN(config.bos_token_id, fields.NullableInt("bos_token_id", kDefaultBosTokenId));
  ASSIGN_OR_RETURN(config.pad_token_id, fields.NullableInt("pad_token_id", std::nullopt));
  const Json* eos = fields.Find("eos_token_id");
  if (eos == nullptr) {
    config.eos_token_ids = {kDefaultEosTokenId};
  } else if (eos->is_array()) {
    for (const Json& id : *eos) {
      if (!id.is_number_integer()) {
        return fields.WrongType("eos_token_id", "an integer or an array of integers", *eos);
      }
      ASSIGN_OR_RETURN(int64_t value, fields.AsInt("eos_token_id", id));
      config.eos_token_ids.push_back(value);
    }
  } else if (!eos->is_null()) {
    if (!eos->is_number_integer()) {
      return fields.WrongType("eos_token_id", "an integer or an array of integers", *eos);
    }
    ASSIGN_OR_RETURN(int64_t value, fields.AsInt("eos_token_id", *eos));
    config.eos_token_ids = {value};
  }
  return absl::OkStatus();
}

absl::Status ParseFields(const Json& root, ModelConfig& config) {
  const Fields fields(root, "");
  ASSIGN_OR_RETURN(config.architecture, ParseArchitecture(fields));
  const bool glm = config.architecture == Architecture::kGlmMoeDsa;
  const ArchitectureDefaults& defaults = glm ? kGlmMoeDsaDefaults : kDeepseekV3Defaults;
  ASSIGN_OR_RETURN(config.model_type,
                   fields.String("model_type", std::string(DefaultModelType(config.architecture))));

  ASSIGN_OR_RETURN(config.vocab_size, fields.RequiredInt("vocab_size"));
  ASSIGN_OR_RETURN(config.hidden_size, fields.RequiredInt("hidden_size"));
  ASSIGN_OR_RETURN(config.intermediate_size, fields.RequiredInt("intermediate_size"));
  ASSIGN_OR_RETURN(config.moe_intermediate_size, fields.RequiredInt("moe_intermediate_size"));
  ASSIGN_OR_RETURN(config.num_hidden_layers, fields.RequiredInt("num_hidden_layers"));
  // Bounded before anything is sized per layer.
  RETURN_IF_ERROR(CheckRange("num_hidden_layers", config.num_hidden_layers, 1, kMaxLayers));
  ASSIGN_OR_RETURN(config.num_attention_heads, fields.RequiredInt("num_attention_heads"));
  // DeepseekV3Config: "for backward compatibility", absent or null means num_attention_heads.
  ASSIGN_OR_RETURN(std::optional<int64_t> kv_heads,
                   fields.NullableInt("num_key_value_heads", std::nullopt));
  config.num_key_value_heads = kv_heads.value_or(config.num_attention_heads);

  // q_lora_rank is required but nullable: HF fills an absent one with 1536 / 2048, while
  // DeepSeek-V2-Lite writes null for "no q LoRA"; we make the config say which it means.
  if (!fields.Has("q_lora_rank")) {
    return fields.Missing("q_lora_rank", " (use null for a plain q_proj)");
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> q_lora_rank,
                   fields.NullableInt("q_lora_rank", std::nullopt));
  config.q_lora_rank = q_lora_rank.value_or(0);
  ASSIGN_OR_RETURN(config.kv_lora_rank, fields.RequiredInt("kv_lora_rank"));
  ASSIGN_OR_RETURN(config.qk_nope_head_dim, fields.RequiredInt("qk_nope_head_dim"));
  ASSIGN_OR_RETURN(config.qk_rope_head_dim, fields.RequiredInt("qk_rope_head_dim"));
  ASSIGN_OR_RETURN(config.v_head_dim, fields.RequiredInt("v_head_dim"));
  ASSIGN_OR_RETURN(std::optional<int64_t> qk_head_dim,
                   fields.NullableInt("qk_head_dim", std::nullopt));
  if (qk_head_dim.has_value() && *qk_head_dim != config.QkHeadDim()) {
    return Invalid("qk_head_dim ", *qk_head_dim,
                   " != qk_nope_head_dim + qk_rope_head_dim = ", config.QkHeadDim());
  }
  ASSIGN_OR_RETURN(config.attention_bias, fields.Bool("attention_bias", false));

  ASSIGN_OR_RETURN(config.n_routed_experts, fields.RequiredInt("n_routed_experts"));
  ASSIGN_OR_RETURN(config.num_experts_per_tok, fields.RequiredInt("num_experts_per_tok"));
  ASSIGN_OR_RETURN(config.n_shared_experts, fields.Int("n_shared_experts", kDefaultNSharedExperts));
  ASSIGN_OR_RETURN(config.n_group, fields.Int("n_group", defaults.n_group));
  ASSIGN_OR_RETURN(config.topk_group, fields.Int("topk_group", defaults.topk_group));
  ASSIGN_OR_RETURN(config.routed_scaling_factor,
                   fields.Double("routed_scaling_factor", kDefaultRoutedScalingFactor));
  ASSIGN_OR_RETURN(config.norm_topk_prob, fields.Bool("norm_topk_prob", true));
  ASSIGN_OR_RETURN(std::string scoring_func, fields.String("scoring_func", "sigmoid"));
  RETURN_IF_ERROR(CheckSupported(fields, "scoring_func", scoring_func, {"sigmoid"}));
  ASSIGN_OR_RETURN(std::string topk_method, fields.String("topk_method", "noaux_tc"));
  RETURN_IF_ERROR(CheckSupported(fields, "topk_method", topk_method, {"noaux_tc"}));
  RETURN_IF_ERROR(ParseMlpKinds(fields, config));

  ASSIGN_OR_RETURN(std::string hidden_act, fields.String("hidden_act", "silu"));
  RETURN_IF_ERROR(CheckSupported(fields, "hidden_act", hidden_act, {"silu"}));
  ASSIGN_OR_RETURN(config.rms_norm_eps, fields.Double("rms_norm_eps", defaults.rms_norm_eps));
  ASSIGN_OR_RETURN(config.max_position_embeddings,
                   fields.Int("max_position_embeddings", defaults.max_position_embeddings));
  ASSIGN_OR_RETURN(config.tie_word_embeddings, fields.Bool("tie_word_embeddings", false));
  RETURN_IF_ERROR(ParseTokens(fields, config));
  ASSIGN_OR_RETURN(config.rope, ParseRopeConfig(root, config.max_position_embeddings));
  ASSIGN_OR_RETURN(config.rope_interleave, fields.Bool("rope_interleave", true));
  RETURN_IF_ERROR(ParseIndexer(fields, config));
  ASSIGN_OR_RETURN(config.num_nextn_predict_layers, fields.Int("num_nextn_predict_layers", 0));
  ASSIGN_OR_RETURN(config.quantization, ParseQuantization(fields));
  // transformers 5 writes "dtype", earlier versions "torch_dtype".
  const char* dtype_key = fields.HasNonNull("dtype") ? "dtype" : "torch_dtype";
  if (fields.HasNonNull(dtype_key)) {
    ASSIGN_OR_RETURN(config.dtype, fields.String(dtype_key, ""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text) {
  ASSIGN_OR_RETURN(Json root, ParseJsonObject(json_text));
  ModelConfig config;
  RETURN_IF_ERROR(ParseFields(root, config));
  RETURN_IF_ERROR(config.Validate());
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = absl::StrCat(model_dir, "/config.json");
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  if (file == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  std::string text;
  char buffer[1 << 16];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), file.get())) {
    text.append(buffer, n);
    if (text.size() > kMaxConfigBytes) {
      return Invalid(path, ": larger than ", kMaxConfigBytes, " bytes; not a config.json");
    }
  }
  if (std::ferror(file.get())) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot read ", path));
  }
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  if (!config.ok()) return nq::Annotate(config.status(), path);
  return config;
}

}  // namespace nq::model
