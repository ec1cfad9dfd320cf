// Rotary position embedding parameters of an MLA model, in the form transformers 5.x
// standardizes them into `rope_parameters`, and the HF math that turns them into inverse
// frequencies and scale factors, and their config.json form in both HF layouts.
//
// RoPE acts only on the `qk_rope_head_dim` slice of each query/key head (HF sets
// `head_dim = qk_rope_head_dim` for both DeepseekV3Config and GlmMoeDsaConfig), so every
// function here takes that width as `rotary_dim`.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::model {

enum class RopeType {
  kDefault,  // "default": plain RoPE, theta only
  kYarn,     // "yarn": NTK-by-parts interpolation (arXiv 2309.00071) with DeepSeek's mscale
};

// "default" / "yarn".
absl::string_view RopeTypeName(RopeType type);

// YaRN parameters. Optional fields keep the config's own spelling (absent vs present) so a
// config written back by ToJson says what the original said; the math treats absent and 0
// alike where HF does (`if mscale and mscale_all_dim`).
struct YarnParams {
  double factor = 1.0;                           // required in the config; >= 1
  int64_t original_max_position_embeddings = 0;  // > 0 (HF fills it from max_position_embeddings)
  double beta_fast = 32.0;                       // HF: `get("beta_fast") or 32`
  double beta_slow = 1.0;                        // HF: `get("beta_slow") or 1`
  std::optional<double> mscale;                  // DeepSeek: numerator mscale
  std::optional<double> mscale_all_dim;          // DeepSeek: denominator mscale, and the
                                                 // softmax-scale correction
  std::optional<double> attention_factor;        // overrides the derived cos/sin factor
  bool truncate = true;                          // HF: floor/ceil the correction range

  bool operator==(const YarnParams&) const = default;
};

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;  // HF RotaryEmbeddingConfigMixin.default_theta
  YarnParams yarn;         // meaningful only when type == kYarn

  // INVALID_ARGUMENT naming the first out-of-range parameter.
  absl::Status Validate() const;

  // Inverse frequencies, rotary_dim / 2 of them: HF `_compute_default_rope_parameters` or
  // `_compute_yarn_parameters`. Evaluated in double; HF evaluates in float32, so compare
  // against HF fixtures with a relative tolerance of about 1e-6. rotary_dim must be even
  // and positive.
  std::vector<double> InvFreq(int64_t rotary_dim) const;

  // HF `attention_scaling`: the factor the rotary embedding multiplies cos and sin by.
  // 1 for default RoPE; for YaRN `attention_factor` if given, else
  // mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are non-zero, else
  // mscale(factor, 1).
  double AttentionFactor() const;

  // DeepSeek's softmax-scale correction, mscale(factor, mscale_all_dim)^2, applied by HF
  // DeepseekV3Attention when the rope type is not "default" and mscale_all_dim is non-zero;
  // 1 otherwise.
  double SoftmaxMscaleSquared() const;

  bool operator==(const RopeConfig&) const = default;
};

// Reads the RoPE keys of a config.json root object the way transformers 5's
// RotaryEmbeddingConfigMixin standardizes them: `rope_scaling` (transformers 4) if present and
// non-empty, else `rope_parameters` (transformers 5); rope_type, else the legacy "type", else
// "default"; rope_theta from that dict, else the top-level key, else 10000; for YaRN the
// top-level original_max_position_embeddings, else the dict's, else
// `max_position_embeddings`. Status codes as ParseModelConfig's (model_config.h). Does not
// run Validate().
absl::StatusOr<RopeConfig> ParseRopeConfig(const nlohmann::json& root,
                                           int64_t max_position_embeddings);

// Writes `rope` into a config.json root object: rope_parameters (with rope_theta inside), the
// top-level rope_theta, and for YaRN rope_scaling (what transformers 4 reads).
void WriteRopeConfig(const RopeConfig& rope, nlohmann::json& root);

// HF / DeepSeek `yarn_get_mscale`: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1.
double YarnGetMscale(double scale, double mscale);

}  // namespace nq::model
