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
// 2: the EMAs and sequence hits in per-layer rows padded to JfFeatureStride (version 1 was
// per-cell interleaved).
constexpr uint32_t kStateVersion = 2;
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
    : layers_(layers), experts_(experts), top_k_(top_k), stride_(JfFeatureStride(experts)) {
  const size_t cells = static_cast<size_t>(layers) * experts;
  const size_t padded_cells = static_cast<size_t>(layers) * stride_;
  inv_pow_.resize(kJfHalfLives * (kMaxPending + 1));
  fold_pow_.resize(kJfHalfLives * (kMaxPending + 1));
  for (uint32_t h = 0; h < kJfHalfLives; ++h) {
    decay_[h] = std::exp2(-1.0 / kJfHalfLife[h]);
    for (uint32_t i = 0; i <= kMaxPending; ++i) {
      inv_pow_[h * (kMaxPending + 1) + i] =
          static_cast<float>((1.0 - decay_[h]) * std::pow(decay_[h], -static_cast<double>(i)));
      fold_pow_[h * (kMaxPending + 1) + i] = static_cast<float>(std::pow(decay_[h], static_cast<double>(i)));
    }
  }
  hit_ema_.assign(padded_cells * kJfHalfLives, 0.0f);
  sal_ema_.assign(padded_cells * kJfHalfLives, 0.0f);
  last_hit_.assign(cells, 0);
  seq_hits_.assign(padded_cells, 0);
  ring_experts_.assign(static_cast<size_t>(kJfWindow) * layers * top_k, 0);
  ring_salience_.assign(ring_experts_.size(), 0.0f);
  // Feature 12 by age: log2 is the costliest part of a Fill otherwise.
  age_feature_.resize(kJfMaxAge + 1);
  for (uint32_t age = 0; age <= kJfMaxAge; ++age) {
    age_feature_[age] = std::log2(1.0f + static_cast<float>(age)) / kAgeScale;
  }
}

void JfFeatureState::Observe(std::span<const uint32_t> experts, std::span<const float> weights,
                             std::span<const float> norms) {
  if (pending_ == kMaxPending) FoldAll();
  ++pending_;
  float step[kJfHalfLives];
  for (uint32_t h = 0; h < kJfHalfLives; ++h) step[h] = inv_pow_[h * (kMaxPending + 1) + pending_];
  const size_t ring_base = (position_ % kJfWindow) * static_cast<size_t>(layers_) * top_k_;
  const uint64_t stamp = position_ + 1;
  for (uint32_t layer = 0; layer < layers_; ++layer) {
    const float n = layer < norms.size() && norms[layer] > 0 && std::isfinite(norms[layer]) ? norms[layer] : 1.0f;
    float* hit = &hit_ema_[EmaRow(layer)];
    float* sal = &sal_ema_[EmaRow(layer)];
    for (uint32_t j = 0; j < top_k_; ++j) {
      const size_t i = static_cast<size_t>(layer) * top_k_ + j;
      const uint32_t e = experts[i];
      const float w = std::isfinite(weights[i]) ? weights[i] : 0.0f;
      const float salience = w * w * n;
      for (uint32_t h = 0; h < kJfHalfLives; ++h) {
        hit[h * stride_ + e] += step[h];
        sal[h * stride_ + e] += step[h] * salience;
      }
      last_hit_[Cell(layer, e)] = stamp;
      ++seq_hits_[PaddedCell(layer, e)];
      ring_experts_[ring_base + i] = e;
      ring_salience_[ring_base + i] = salience;
    }
  }
  ++position_;
}

void JfFeatureState::NewSequence() {
  position_ = 0;
  std::fill(last_hit_.begin(), last_hit_.end(), 0);
  std::fill(seq_hits_.begin(), seq_hits_.end(), 0);
}

namespace {

// dst[i] = src[i] * coef over n floats, n a multiple of kJfExpertBlock (a fixed-width inner
// loop: vectorized at -O2).
void ScaleRow(const float* __restrict src, float coef, float* __restrict dst, uint32_t n) {
  for (uint32_t b = 0; b < n; b += kJfExpertBlock) {
    for (uint32_t j = 0; j < kJfExpertBlock; ++j) dst[b + j] = src[b + j] * coef;
  }
}

// The sum of n floats (n a multiple of kJfExpertBlock) in double, in kJfExpertBlock lanes.
double SumRow(const float* __restrict x, uint32_t n) {
  double lanes[kJfExpertBlock] = {};
  for (uint32_t b = 0; b < n; b += kJfExpertBlock) {
    for (uint32_t j = 0; j < kJfExpertBlock; ++j) lanes[j] += x[b + j];
  }
  double sum = 0;
  for (double lane : lanes) sum += lane;
  return sum;
}

}  // namespace

void JfFeatureState::FoldAll() {
  for (uint32_t layer = 0; layer < layers_; ++layer) {
    for (uint32_t h = 0; h < kJfHalfLives; ++h) {
      const float fold = fold_pow_[h * (kMaxPending + 1) + pending_];
      float* hit = &hit_ema_[EmaRow(layer) + h * stride_];
      float* sal = &sal_ema_[EmaRow(layer) + h * stride_];
      ScaleRow(hit, fold, hit, stride_);
      ScaleRow(sal, fold, sal, stride_);
    }
  }
  pending_ = 0;
}

void JfFeatureState::Fill(uint32_t layer, std::span<const uint8_t> resident, std::span<float> out) const {
  const uint32_t S = stride_;
  const float rate_scale = static_cast<float>(experts_) / static_cast<float>(top_k_);
  const float experts_f = static_cast<float>(experts_);
  float* f = out.data();
  const float* hit = &hit_ema_[EmaRow(layer)];
  const float* sal = &sal_ema_[EmaRow(layer)];
  for (uint32_t h = 0; h < kJfHalfLives; ++h) {
    // 0..4: the stored EMAs are scaled by g^-pending.
    const float fold = fold_pow_[h * (kMaxPending + 1) + pending_];
    ScaleRow(hit + h * S, fold * rate_scale, f + h * S, S);
    // 5..9: shares of the layer's total, where the stored scale cancels.
    const double sum = SumRow(sal + h * S, S);
    ScaleRow(sal + h * S, sum > 0 ? static_cast<float>(experts_f / sum) : 0.0f, f + (kJfHalfLives + h) * S, S);
  }
  // 10, 11: the sequence's last min(position, kJfWindow) tokens.
  float* window_hits = f + 10 * S;
  float* window_salience = f + 11 * S;
  std::fill(window_hits, window_hits + S, 0.0f);
  std::fill(window_salience, window_salience + S, 0.0f);
  const uint64_t window = std::min<uint64_t>(position_, kJfWindow);
  const size_t per_token = static_cast<size_t>(layers_) * top_k_;
  double window_salience_sum = 0;
  for (uint64_t back = 1; back <= window; ++back) {
    const size_t base = ((position_ - back) % kJfWindow) * per_token + static_cast<size_t>(layer) * top_k_;
    for (uint32_t j = 0; j < top_k_; ++j) {
      window_hits[ring_experts_[base + j]] += 1.0f;
      window_salience[ring_experts_[base + j]] += ring_salience_[base + j];
      window_salience_sum += ring_salience_[base + j];
    }
  }
  // x / kJfWindow is exact, so this equals (x / kJfWindow) * rate_scale.
  ScaleRow(window_hits, rate_scale / static_cast<float>(kJfWindow), window_hits, S);
  ScaleRow(window_salience, window_salience_sum > 0 ? static_cast<float>(experts_f / window_salience_sum) : 0.0f,
           window_salience, S);
  // 12..14: per expert; the padding stays 0.
  float* age = f + 12 * S;
  float* position = f + 13 * S;
  float* residency = f + 14 * S;
  const float position_feature = std::log2(1.0f + static_cast<float>(position_)) / kPositionScale;
  const uint64_t* last_hit = &last_hit_[Cell(layer, 0)];
  for (uint32_t e = 0; e < experts_; ++e) {
    age[e] = last_hit[e] == 0 ? 1.0f : age_feature_[std::min<uint64_t>(position_ - last_hit[e], kJfMaxAge)];
    position[e] = position_feature;
    residency[e] = resident[e] != 0 ? 1.0f : 0.0f;
  }
  for (uint32_t e = experts_; e < S; ++e) age[e] = position[e] = residency[e] = 0.0f;
  // 15: hits in this sequence per token.
  const float seq_coef = rate_scale / static_cast<float>(std::max<uint64_t>(position_, 1));
  const uint32_t* seq_hits = &seq_hits_[PaddedCell(layer, 0)];
  float* seq_rate = f + 15 * S;
  for (uint32_t b = 0; b < S; b += kJfExpertBlock) {
    for (uint32_t j = 0; j < kJfExpertBlock; ++j) seq_rate[b + j] = static_cast<float>(seq_hits[b + j]) * seq_coef;
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
