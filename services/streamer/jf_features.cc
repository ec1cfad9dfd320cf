#include "services/streamer/jf_features.h"
#include "services/streamer/state_bytes.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace nq::streamer {
namespace {

// Observe folds every kMaxPending tokens, so the scaled-up increments (1 - g) g^-i stay below
// 2^(kMaxPending / 8) = 256 for the shortest half-life.
constexpr uint32_t kMaxPending = 64;
constexpr char kStateMagic[4] = {'N', 'Q', 'J', 'S'};
constexpr uint32_t kStateVersion = 1;
// log2(1 + kJfMaxAge) rounded up, and log2 of 65536 tokens: the scales of features 12, 13.
constexpr float kAgeScale = 11.0f;
constexpr float kPositionScale = 16.0f;
}  // namespace

absl::StatusOr<JfFeatureState> JfFeatureState::Create(uint32_t num_layers,
                                                       uint32_t experts_per_layer,
                                                       uint32_t top_k) {
  if (num_layers == 0 || experts_per_layer == 0 || top_k == 0 || top_k > experts_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat("jF features need layers, experts and top_k "
                                                   ">= 1, top_k <= experts; got ",
                                                   num_layers, " x ", experts_per_layer,
                                                   ", top_k ", top_k));
  }
  return JfFeatureState(num_layers, experts_per_layer, top_k);
}

JfFeatureState::JfFeatureState(uint32_t layers, uint32_t experts, uint32_t top_k)
    : layers_(layers), experts_(experts), top_k_(top_k) {
  const size_t cells = static_cast<size_t>(layers) * experts;
  inv_pow_.resize(kJfHalfLives * (kMaxPending + 1));
  for (uint32_t h = 0; h < kJfHalfLives; ++h) {
    decay_[h] = std::exp2(-1.0 / kJfHalfLife[h]);
    for (uint32_t i = 0; i <= kMaxPending; ++i) {
      inv_pow_[h * (kMaxPending + 1) + i] =
          static_cast<float>((1.0 - decay_[h]) * std::pow(decay_[h], -static_cast<double>(i)));
    }
  }
  hit_ema_.assign(cells * kJfHalfLives, 0.0f);
  sal_ema_.assign(cells * kJfHalfLives, 0.0f);
  last_hit_.assign(cells, 0);
  seq_hits_.assign(cells, 0);
  ring_experts_.assign(static_cast<size_t>(kJfWindow) * layers * top_k, 0);
  ring_salience_.assign(ring_experts_.size(), 0.0f);
  // Feature 12 by age: log2 is the costliest part of a Fill otherwise.
  age_feature_.resize(kJfMaxAge + 1);
  for (uint32_t age = 0; age <= kJfMaxAge; ++age) {
    age_feature_[age] = std::log2(1.0f + static_cast<float>(age)) / kAgeScale;
  }
  window_hits_.resize(experts);
  window_salience_.resize(experts);
}

void JfFeatureState::Observe(std::span<const uint32_t> experts, std::span<const float> weights,
                             std::span<const float> norms) {
  if (pending_ == kMaxPending) FoldAll();
  ++pending_;
  float step[kJfHalfLives];
  for (uint32_t h = 0; h < kJfHalfLives; ++h) step[h] = inv_pow_[h * (kMaxPending + 1) + pending_];
  const size_t per_token = static_cast<size_t>(layers_) * top_k_;
  const size_t ring_base = (position_ % kJfWindow) * per_token;
  for (size_t i = 0; i < per_token; ++i) {
    const uint32_t layer = static_cast<uint32_t>(i / top_k_);
    const float w = std::isfinite(weights[i]) ? weights[i] : 0.0f;
    const float n = layer < norms.size() && norms[layer] > 0 && std::isfinite(norms[layer])
                        ? norms[layer]
                        : 1.0f;
    const float salience = w * w * n;
    const size_t cell = Cell(layer, experts[i]);
    float* hit = &hit_ema_[cell * kJfHalfLives];
    float* sal = &sal_ema_[cell * kJfHalfLives];
    for (uint32_t h = 0; h < kJfHalfLives; ++h) {
      hit[h] += step[h];
      sal[h] += step[h] * salience;
    }
    last_hit_[cell] = position_ + 1;
    ++seq_hits_[cell];
    ring_experts_[ring_base + i] = experts[i];
    ring_salience_[ring_base + i] = salience;
  }
  ++position_;
}

void JfFeatureState::NewSequence() {
  position_ = 0;
  std::fill(last_hit_.begin(), last_hit_.end(), 0);
  std::fill(seq_hits_.begin(), seq_hits_.end(), 0);
}

void JfFeatureState::FoldAll() {
  for (uint32_t h = 0; h < kJfHalfLives; ++h) {
    const float fold = static_cast<float>(std::pow(decay_[h], pending_));
    for (size_t i = h; i < hit_ema_.size(); i += kJfHalfLives) {
      hit_ema_[i] *= fold;
      sal_ema_[i] *= fold;
    }
  }
  pending_ = 0;
}

void JfFeatureState::Fill(uint32_t layer, std::span<const uint8_t> resident, std::span<float> out) {
  if (pending_ > 0) FoldAll();
  const float rate_scale = static_cast<float>(experts_) / static_cast<float>(top_k_);
  const float experts_f = static_cast<float>(experts_);
  // The window: the sequence's last min(position, kJfWindow) tokens.
  std::fill(window_hits_.begin(), window_hits_.end(), 0.0f);
  std::fill(window_salience_.begin(), window_salience_.end(), 0.0f);
  const uint64_t window = std::min<uint64_t>(position_, kJfWindow);
  const size_t per_token = static_cast<size_t>(layers_) * top_k_;
  double window_salience_sum = 0;
  for (uint64_t back = 1; back <= window; ++back) {
    const size_t base = ((position_ - back) % kJfWindow) * per_token + static_cast<size_t>(layer) * top_k_;
    for (uint32_t j = 0; j < top_k_; ++j) {
      window_hits_[ring_experts_[base + j]] += 1.0f;
      window_salience_[ring_experts_[base + j]] += ring_salience_[base + j];
      window_salience_sum += ring_salience_[base + j];
    }
  }
  double sal_sum[kJfHalfLives] = {};
  const size_t first = Cell(layer, 0);
  for (uint32_t e = 0; e < experts_; ++e) {
    for (uint32_t h = 0; h < kJfHalfLives; ++h) sal_sum[h] += sal_ema_[(first + e) * kJfHalfLives + h];
  }
  float sal_coef[kJfHalfLives];
  for (uint32_t h = 0; h < kJfHalfLives; ++h) {
    sal_coef[h] = sal_sum[h] > 0 ? static_cast<float>(experts_f / sal_sum[h]) : 0.0f;
  }
  const float window_coef = window_salience_sum > 0 ? static_cast<float>(experts_f / window_salience_sum) : 0.0f;
  const float position_feature = std::log2(1.0f + static_cast<float>(position_)) / kPositionScale;
  const float seq_coef = rate_scale / static_cast<float>(std::max<uint64_t>(position_, 1));
  for (uint32_t e = 0; e < experts_; ++e) {
    const size_t cell = first + e;
    float* f = &out[static_cast<size_t>(e) * kJfFeatures];
    for (uint32_t h = 0; h < kJfHalfLives; ++h) {
      f[h] = hit_ema_[cell * kJfHalfLives + h] * rate_scale;
      f[kJfHalfLives + h] = sal_ema_[cell * kJfHalfLives + h] * sal_coef[h];
    }
    f[10] = window_hits_[e] / static_cast<float>(kJfWindow) * rate_scale;
    f[11] = window_salience_[e] * window_coef;
    const uint64_t age = last_hit_[cell] == 0 ? kJfMaxAge : std::min<uint64_t>(position_ - last_hit_[cell], kJfMaxAge);
    f[12] = last_hit_[cell] == 0 ? 1.0f : age_feature_[age];
    f[13] = position_feature;
    f[14] = resident[e] != 0 ? 1.0f : 0.0f;
    f[15] = static_cast<float>(seq_hits_[cell]) * seq_coef;
  }
}

std::string JfFeatureState::Save() const {
  std::string out;
  out.append(kStateMagic, 4);
  PutValue(kStateVersion, &out);
  PutValue(layers_, &out);
  PutValue(experts_, &out);
  PutValue(top_k_, &out);
  PutValue(position_, &out);
  PutValue(pending_, &out);
  PutVector(hit_ema_, &out);
  PutVector(sal_ema_, &out);
  PutVector(last_hit_, &out);
  PutVector(seq_hits_, &out);
  PutVector(ring_experts_, &out);
  PutVector(ring_salience_, &out);
  return out;
}

absl::Status JfFeatureState::Restore(std::string_view bytes) {
  StateBytesReader in(bytes);
  char magic[4];
  uint32_t version = 0, layers = 0, experts = 0, top_k = 0, pending = 0;
  uint64_t position = 0;
  if (!in.Get(&magic) || std::memcmp(magic, kStateMagic, 4) != 0) {
    return absl::DataLossError("not a jF feature state (bad magic)");
  }
  if (!in.Get(&version) || version != kStateVersion) {
    return absl::DataLossError(absl::StrCat("jF feature state version ", version, ", this build reads ",
                                            kStateVersion));
  }
  if (!in.Get(&layers) || !in.Get(&experts) || !in.Get(&top_k) || !in.Get(&position) || !in.Get(&pending)) {
    return absl::DataLossError("jF feature state truncated in its header");
  }
  if (layers != layers_ || experts != experts_ || top_k != top_k_) {
    return absl::InvalidArgumentError(absl::StrCat("jF feature state is for ", layers, " layers x ", experts,
                                                   " experts, top_k ", top_k, "; this predictor has ", layers_,
                                                   " x ", experts_, ", top_k ", top_k_));
  }
  if (pending > kMaxPending) return absl::DataLossError("jF feature state has a bad pending count");
  JfFeatureState next = *this;
  next.position_ = position;
  next.pending_ = pending;
  if (!in.GetVector(&next.hit_ema_) || !in.GetVector(&next.sal_ema_) || !in.GetVector(&next.last_hit_) ||
      !in.GetVector(&next.seq_hits_) || !in.GetVector(&next.ring_experts_) || !in.GetVector(&next.ring_salience_)) {
    return absl::DataLossError("jF feature state truncated in its arrays");
  }
  if (!in.done()) return absl::DataLossError("jF feature state has trailing bytes");
  for (uint32_t e : next.ring_experts_) {
    if (e >= experts_) return absl::DataLossError("jF feature state has an expert id out of range");
  }
  for (uint64_t last : next.last_hit_) {
    if (last > position) return absl::DataLossError("jF feature state has a last hit after its position");
  }
  *this = std::move(next);
  return absl::OkStatus();
}

}  // namespace nq::streamer
