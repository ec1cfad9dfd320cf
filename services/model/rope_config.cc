#include "services/model/rope_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::model {
namespace {

// HF `linear_ramp_factor` widens a degenerate ramp by this much to avoid dividing by zero.
constexpr double kRampSingularityGuard = 0.001;

// HF `find_correction_dim`: the rotary dimension whose wavelength completes `num_rotations`
// turns over `max_position_embeddings` positions.
double FindCorrectionDim(double num_rotations, int64_t dim, double base,
                         int64_t max_position_embeddings) {
  return (static_cast<double>(dim) * std::log(static_cast<double>(max_position_embeddings) /
                                              (num_rotations * 2.0 * std::numbers::pi))) /
         (2.0 * std::log(base));
}

bool NonZero(const std::optional<double>& value) { return value.has_value() && *value != 0.0; }

using Json = nlohmann::json;

// Typed reads of one key of a rope dict (or of the config root, path ""), with errors worded
// like model_config.cc's: the key by its full path, the expected and the actual JSON type.
class RopeFields {
 public:
  RopeFields(const Json& object, const char* path) : object_(object), path_(path) {}

  std::string Name(const std::string& key) const {
    return path_[0] == '\0' ? key : absl::StrCat(path_, ".", key);
  }
  const Json* Find(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  absl::Status WrongType(const char* key, const char* expected, const Json& value) const {
    std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
    return absl::InvalidArgumentError(absl::StrCat("key \"", Name(key), "\" must be ", expected,
                                                   ", got ", value.type_name(), " ", text));
  }
  // Absent or null: nullopt.
  absl::StatusOr<std::optional<double>> Number(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::optional<double>();
    if (!value->is_number()) return WrongType(key, "a number", *value);
    return std::optional<double>(value->get<double>());
  }
  absl::StatusOr<std::optional<int64_t>> Integer(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::optional<int64_t>();
    if (!value->is_number_integer() ||
        (value->is_number_unsigned() &&
         value->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      return WrongType(key, "an integer", *value);
    }
    return std::optional<int64_t>(value->get<int64_t>());
  }
  absl::StatusOr<std::optional<std::string>> String(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::optional<std::string>();
    if (!value->is_string()) return WrongType(key, "a string", *value);
    return std::optional<std::string>(value->get<std::string>());
  }
  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return WrongType(key, "a boolean", *value);
    return value->get<bool>();
  }

 private:
  const Json& object_;
  const char* path_;
};

// The dict HF reads: `rope_parameters = rope_scaling or rope_parameters` (empty is falsy).
absl::StatusOr<std::pair<const Json*, const char*>> SelectRopeDict(const Json& root) {
  const RopeFields fields(root, "");
  std::pair<const Json*, const char*> chosen{nullptr, "rope_parameters"};
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    const Json* dict = fields.Find(key);
    if (dict == nullptr) continue;
    if (!dict->is_object()) return fields.WrongType(key, "an object", *dict);
    if (!dict->empty() || chosen.first == nullptr) chosen = {dict, key};
  }
  return chosen;
}

}  // namespace

absl::StatusOr<RopeConfig> ParseRopeConfig(const Json& root, int64_t max_position_embeddings) {
  ASSIGN_OR_RETURN(auto selected, SelectRopeDict(root));
  const Json empty = Json::object();
  const RopeFields rope(selected.first != nullptr ? *selected.first : empty, selected.second);
  const RopeFields top(root, "");
  if (selected.first != nullptr) {
    for (const auto& [key, value] : selected.first->items()) {
      if (value.is_object()) {
        return absl::UnimplementedError(
            absl::StrCat(rope.Name(key), ": per-layer-type rope parameters are not supported"));
      }
    }
  }

  RopeConfig config;
  ASSIGN_OR_RETURN(std::optional<std::string> legacy_type, rope.String("type"));
  ASSIGN_OR_RETURN(std::optional<std::string> type, rope.String("rope_type"));
  const std::string type_name = type.value_or(legacy_type.value_or("default"));
  if (type_name == "default") {
    config.type = RopeType::kDefault;
  } else if (type_name == "yarn") {
    config.type = RopeType::kYarn;
  } else {
    return absl::UnimplementedError(absl::StrCat(rope.Name("rope_type"), " \"", type_name,
                                                 "\" is not supported; supported: default, yarn"));
  }
  // The dict's rope_theta wins over the top-level key (HF `setdefault`).
  ASSIGN_OR_RETURN(std::optional<double> top_theta, top.Number("rope_theta"));
  ASSIGN_OR_RETURN(std::optional<double> theta, rope.Number("rope_theta"));
  config.theta = theta.value_or(top_theta.value_or(config.theta));
  for (const RopeFields* owner : {&rope, &top}) {
    ASSIGN_OR_RETURN(std::optional<double> partial, owner->Number("partial_rotary_factor"));
    if (partial.value_or(1.0) != 1.0) {
      return absl::UnimplementedError(
          absl::StrCat(owner->Name("partial_rotary_factor"), " ", *partial,
                       " is not supported: RoPE covers the whole qk_rope_head_dim slice"));
    }
  }
  if (config.type != RopeType::kYarn) return config;

  YarnParams& yarn = config.yarn;
  ASSIGN_OR_RETURN(std::optional<double> factor, rope.Number("factor"));
  if (!factor.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("missing required key \"", rope.Name("factor"), "\" (yarn needs it)"));
  }
  yarn.factor = *factor;
  // HF standardize_rope_params gives a top-level original_max_position_embeddings priority.
  ASSIGN_OR_RETURN(std::optional<int64_t> top_original,
                   top.Integer("original_max_position_embeddings"));
  ASSIGN_OR_RETURN(std::optional<int64_t> original,
                   rope.Integer("original_max_position_embeddings"));
  yarn.original_max_position_embeddings =
      top_original.value_or(original.value_or(max_position_embeddings));
  // HF: `get("beta_fast") or 32`, `get("beta_slow") or 1`: absent, null and 0 all default.
  ASSIGN_OR_RETURN(std::optional<double> beta_fast, rope.Number("beta_fast"));
  ASSIGN_OR_RETURN(std::optional<double> beta_slow, rope.Number("beta_slow"));
  yarn.beta_fast = beta_fast.value_or(0.0) != 0.0 ? *beta_fast : 32.0;
  yarn.beta_slow = beta_slow.value_or(0.0) != 0.0 ? *beta_slow : 1.0;
  ASSIGN_OR_RETURN(yarn.mscale, rope.Number("mscale"));
  ASSIGN_OR_RETURN(yarn.mscale_all_dim, rope.Number("mscale_all_dim"));
  ASSIGN_OR_RETURN(yarn.attention_factor, rope.Number("attention_factor"));
  ASSIGN_OR_RETURN(yarn.truncate, rope.Bool("truncate", true));
  return config;
}

void WriteRopeConfig(const RopeConfig& rope, Json& root) {
  Json dict = Json::object();
  dict["rope_type"] = std::string(RopeTypeName(rope.type));
  if (rope.type == RopeType::kYarn) {
    const YarnParams& yarn = rope.yarn;
    dict["factor"] = yarn.factor;
    dict["original_max_position_embeddings"] = yarn.original_max_position_embeddings;
    dict["beta_fast"] = yarn.beta_fast;
    dict["beta_slow"] = yarn.beta_slow;
    if (yarn.mscale.has_value()) dict["mscale"] = *yarn.mscale;
    if (yarn.mscale_all_dim.has_value()) dict["mscale_all_dim"] = *yarn.mscale_all_dim;
    if (yarn.attention_factor.has_value()) dict["attention_factor"] = *yarn.attention_factor;
    if (!yarn.truncate) dict["truncate"] = false;
    root["rope_scaling"] = dict;
  }
  dict["rope_theta"] = rope.theta;
  root["rope_parameters"] = std::move(dict);
  root["rope_theta"] = rope.theta;
}

absl::string_view RopeTypeName(RopeType type) {
  switch (type) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kYarn:
      return "yarn";
  }
  return "unknown";
}

double YarnGetMscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

absl::Status RopeConfig::Validate() const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("rope_parameters: ", parts...));
  };
  if (!(theta > 1.0) || !std::isfinite(theta)) {
    return invalid("rope_theta must be a finite number > 1, got ", theta);
  }
  if (type != RopeType::kYarn) return absl::OkStatus();
  if (!(yarn.factor >= 1.0) || !std::isfinite(yarn.factor)) {
    return invalid("yarn factor must be a finite number >= 1, got ", yarn.factor);
  }
  if (yarn.original_max_position_embeddings <= 0) {
    return invalid("original_max_position_embeddings must be > 0, got ",
                   yarn.original_max_position_embeddings);
  }
  if (!(yarn.beta_fast > 0.0) || !(yarn.beta_slow > 0.0)) {
    return invalid("beta_fast and beta_slow must be > 0, got ", yarn.beta_fast, " and ",
                   yarn.beta_slow);
  }
  if (yarn.beta_fast < yarn.beta_slow) {
    return invalid("beta_fast (", yarn.beta_fast, ") must be >= beta_slow (", yarn.beta_slow, ")");
  }
  if (yarn.attention_factor.has_value() && !(*yarn.attention_factor > 0.0)) {
    return invalid("attention_factor must be > 0, got ", *yarn.attention_factor);
  }
  for (const auto& [name, value] :
       {std::pair{"mscale", yarn.mscale}, std::pair{"mscale_all_dim", yarn.mscale_all_dim}}) {
    if (value.has_value() && (!std::isfinite(*value) || *value < 0.0)) {
      return invalid(name, " must be a finite number >= 0, got ", *value);
    }
  }
  return absl::OkStatus();
}

std::vector<double> RopeConfig::InvFreq(int64_t rotary_dim) const {
  const int64_t half = rotary_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(std::max<int64_t>(half, 0)));
  const double dim = static_cast<double>(rotary_dim);
  for (int64_t i = 0; i < half; ++i) {
    // base ** (arange(0, dim, 2) / dim)
    inv_freq[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / dim);
  }
  if (type != RopeType::kYarn) return inv_freq;

  double low =
      FindCorrectionDim(yarn.beta_fast, rotary_dim, theta, yarn.original_max_position_embeddings);
  double high =
      FindCorrectionDim(yarn.beta_slow, rotary_dim, theta, yarn.original_max_position_embeddings);
  if (yarn.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += kRampSingularityGuard;

  for (int64_t i = 0; i < half; ++i) {
    const double extrapolation = inv_freq[i];
    const double interpolation = extrapolation / yarn.factor;
    // ramp is 0 for the high-frequency dims below `low` (kept as trained: extrapolation)
    // and 1 above `high` (fully interpolated), linear in between.
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1.0 - ramp;
    inv_freq[i] =
        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv_freq;
}

double RopeConfig::AttentionFactor() const {
  if (type != RopeType::kYarn) return 1.0;
  if (yarn.attention_factor.has_value()) return *yarn.attention_factor;
  if (NonZero(yarn.mscale) && NonZero(yarn.mscale_all_dim)) {
    return YarnGetMscale(yarn.factor, *yarn.mscale) /
           YarnGetMscale(yarn.factor, *yarn.mscale_all_dim);
  }
  return YarnGetMscale(yarn.factor, 1.0);
}

double RopeConfig::SoftmaxMscaleSquared() const {
  if (type == RopeType::kDefault || !NonZero(yarn.mscale_all_dim)) return 1.0;
  const double mscale = YarnGetMscale(yarn.factor, *yarn.mscale_all_dim);
  return mscale * mscale;
}

}  // namespace nq::model
