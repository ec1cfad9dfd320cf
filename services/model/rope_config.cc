#include "services/model/rope_config.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace nq::model {
namespace {

// HF `linear_ramp_factor` widens a degenerate ramp by this much to avoid dividing by zero.
constexpr double kRampSingularityGuard = 0.001;

// HF `find_correction_dim`: the rotary dimension whose wavelength completes `num_rotations`
// turns over `max_position_embeddings` positions.
double FindCorrectionDim(double num_rotations, int64_t dim, double base,
                         int64_t max_position_embeddings) {
  return (static_cast<double>(dim) *
          std::log(static_cast<double>(max_position_embeddings) /
                   (num_rotations * 2.0 * std::numbers::pi))) /
         (2.0 * std::log(base));
}

bool NonZero(const std::optional<double>& value) { return value.has_value() && *value != 0.0; }

}  // namespace

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
    return invalid("beta_fast (", yarn.beta_fast, ") must be >= beta_slow (", yarn.beta_slow,
                   ")");
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

  double low = FindCorrectionDim(yarn.beta_fast, rotary_dim, theta,
                                 yarn.original_max_position_embeddings);
  double high = FindCorrectionDim(yarn.beta_slow, rotary_dim, theta,
                                  yarn.original_max_position_embeddings);
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
    inv_freq[i] = interpolation * (1.0 - extrapolation_factor) +
                  extrapolation * extrapolation_factor;
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
