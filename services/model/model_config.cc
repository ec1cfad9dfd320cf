#include "services/model/model_config.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"

namespace nq::model {
namespace {

using Json = nlohmann::json;

// Sanity bounds that keep a corrupt config from sizing per-layer tables or products of
// dimensions absurdly. Real models: < 200 layers, dimensions < 2^20.
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxSize = int64_t{1} << 24;
// A config.json is a few KiB (GLM-5-FP8's, with its modules_to_not_convert list, tens of KiB).
constexpr size_t kMaxConfigBytes = size_t{16} << 20;
// Longest value quoted back in an error message.
constexpr size_t kMaxQuotedValue = 60;

constexpr char kGlmMoeDsaName[] = "GlmMoeDsaForCausalLM";
constexpr char kDeepseekV3Name[] = "DeepseekV3ForCausalLM";

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

absl::Status Invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }
absl::Status Unimplemented(auto&&... parts) {
  return absl::UnimplementedError(absl::StrCat(parts...));
}

absl::Status CheckRange(const char* name, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    return Invalid(name, " ", value, " is outside [", min, ", ", max, "]");
  }
  return absl::OkStatus();
}

std::string Quote(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > kMaxQuotedValue) text = text.substr(0, kMaxQuotedValue) + "...";
  return text;
}

// Typed, defaulted access to the keys of one JSON object, with errors that name the key by
// its full path ("quantization_config.fmt"). Absent keys take the fallback; a present null
// is a type error unless the accessor says it is nullable. Nothing here throws.
class Fields {
 public:
  Fields(const Json& object, std::string path) : object_(object), path_(std::move(path)) {}

  const Json* Find(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  bool Has(const char* key) const { return Find(key) != nullptr; }
  bool HasNonNull(const char* key) const {
    const Json* value = Find(key);
    return value != nullptr && !value->is_null();
  }
  std::string Name(const char* key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }
  absl::Status Missing(const char* key, absl::string_view hint = "") const {
    return Invalid("missing required key \"", Name(key), "\"", hint);
  }
  absl::Status WrongType(const char* key, absl::string_view expected, const Json& value) const {
    return Invalid("key \"", Name(key), "\" must be ", expected, ", got ", value.type_name(), " ",
                   Quote(value));
  }

  absl::StatusOr<int64_t> AsInt(const char* key, const Json& value) const {
    if (!value.is_number_integer()) return WrongType(key, "an integer", value);
    if (value.is_number_unsigned() &&
        value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid("key \"", Name(key), "\" is out of range: ", Quote(value));
    }
    return value.get<int64_t>();
  }
  absl::StatusOr<int64_t> RequiredInt(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return Missing(key);
    return AsInt(key, *value);
  }
  absl::StatusOr<int64_t> Int(const char* key, int64_t fallback) const {
    const Json* value = Find(key);
    return value == nullptr ? fallback : AsInt(key, *value);
  }
  // Absent: `fallback`; null: nullopt.
  absl::StatusOr<std::optional<int64_t>> NullableInt(const char* key,
                                                     std::optional<int64_t> fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (value->is_null()) return std::optional<int64_t>();
    ASSIGN_OR_RETURN(int64_t result, AsInt(key, *value));
    return std::optional<int64_t>(result);
  }
  absl::StatusOr<double> Double(const char* key, double fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_number()) return WrongType(key, "a number", *value);
    return value->get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return WrongType(key, "a boolean", *value);
    return value->get<bool>();
  }
  absl::StatusOr<std::string> String(const char* key, std::string fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_string()) return WrongType(key, "a string", *value);
    return value->get<std::string>();
  }
  absl::StatusOr<std::vector<std::string>> StringList(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return Missing(key);
    if (!value->is_array()) return WrongType(key, "an array of strings", *value);
    std::vector<std::string> out;
    for (const Json& item : *value) {
      if (!item.is_string()) return WrongType(key, "an array of strings", *value);
      out.push_back(item.get<std::string>());
    }
    return out;
  }
  // The nested object at `key`, or nullptr when absent or null.
  absl::StatusOr<const Json*> Object(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr || value->is_null()) return nullptr;
    if (!value->is_object()) return WrongType(key, "an object", *value);
    return value;
  }

 private:
  const Json& object_;
  std::string path_;
};

// Records where nlohmann's parser gave up, to report malformed JSON with its position.
class ParseErrorRecorder : public nlohmann::json_sax<Json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& error) override {
    // what() reads "[json.exception.parse_error.101] parse error at line 3, column 5: ...".
    std::string what = error.what();
    const size_t bracket = what.find("] ");
    message_ = bracket == std::string::npos ? what : what.substr(bracket + 2);
    return false;
  }
  std::string Describe() const { return absl::StrCat("malformed JSON: ", message_); }

 private:
  std::string message_ = "unknown error";
};

absl::StatusOr<Json> ParseJson(const std::string& text) {
  Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    ParseErrorRecorder recorder;
    Json::sax_parse(text, &recorder);
    return Invalid(recorder.Describe());
  }
  if (!root.is_object())
    return Invalid("config.json must be a JSON object, got ", root.type_name());
  return root;
}

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

std::vector<MlpKind> DenseThenMoe(int64_t num_layers, int64_t first_k_dense) {
  std::vector<MlpKind> kinds(num_layers, MlpKind::kMoe);
  for (int64_t i = 0; i < first_k_dense && i < num_layers; ++i) kinds[i] = MlpKind::kDense;
  return kinds;
}

int64_t LeadingDense(const std::vector<MlpKind>& kinds) {
  int64_t count = 0;
  while (count < static_cast<int64_t>(kinds.size()) && kinds[count] == MlpKind::kDense) ++count;
  return count;
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
  RETURN_IF_ERROR(CheckSupported(fields, "quant_method", method, {"fp8"}));
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

int64_t ModelConfig::FirstKDenseReplace() const { return LeadingDense(mlp_kinds); }

double ModelConfig::SoftmaxScale() const {
  // Both architectures apply the YaRN mscale correction (transformers 5.17's
  // GlmMoeDsaAttention and DeepseekV3Attention alike; docs/model_math.md section 5.2).
  const double scale = 1.0 / std::sqrt(static_cast<double>(QkHeadDim()));
  return scale * rope.SoftmaxMscaleSquared();
}

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
  if (quantization.has_value()) {
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

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text) {
  ASSIGN_OR_RETURN(Json root, ParseJson(json_text));
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
