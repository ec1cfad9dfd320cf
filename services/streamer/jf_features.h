// The learned predictor's inputs (issue #21, DESIGN.md section 7): per (layer, expert), a
// fixed vector of kJfFeatures signals computed from the routing the predictor has observed.
// scripts/predictor/jf_features.py computes the same features from a trace for training;
// tests/streamer/jf_features_test.cc checks the two agree on a committed fixture, so change
// both together and bump kJfFeatureSet (a learned model names the set it was trained on, and
// the streamer refuses a model trained on another).
//
// Per routed call of a token at layer l (expert e, routing weight w, input norm n = the
// squared norm of the token's input to the layer, 1 when unreported): hit = 1 and
// salience = w^2 * n. The features of (l, e), in this order:
//   0..4   hit EMA at half-lives 8, 32, 128, 512, 2048 tokens, x experts / top_k
//          (1.0 = a uniform router's rate)
//   5..9   salience EMA at the same half-lives, as a share of layer l's total x experts
//   10     hits in the sequence's last 16 tokens / 16 x experts / top_k
//   11     salience in the sequence's last 16 tokens, as a share of layer l's x experts
//   12     tokens since the last hit in this sequence: log2(1 + min(age, 2048)) / 11
//          (1.0 when none yet)
//   13     position in the sequence: log2(1 + tokens observed in it) / 16
//   14     residency: 1 when (l, e) holds a floating 4-bit slot, else 0
//   15     hits in this sequence / max(1, its tokens) x experts / top_k
// EMAs are token-weighted: ema <- g ema + (1 - g) x, g = 2^(-1 / half_life), from 0; they
// carry over between sequences (the model's general popularity). NewSequence clears the
// per-request signals (10..13, 15).
//
// Layout: structure of arrays. The EMAs are stored per layer and half-life as contiguous rows
// over the experts, and Fill writes a layer's features feature-major (one row of experts per
// feature, rows JfFeatureStride(experts) apart, the padding zero), so that Fill and the model's
// forward run over contiguous floats in fixed-width blocks the compiler vectorizes at -O2.
//
// Cost: Observe is O(layers * top_k * 10) and folds every 64 tokens (O(layers * experts * 10));
// Fill is O(experts * kJfFeatures) and writes nothing of the state. Not thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::streamer {

inline constexpr uint32_t kJfFeatures = 16;
inline constexpr uint32_t kJfHalfLives = 5;
inline constexpr double kJfHalfLife[kJfHalfLives] = {8, 32, 128, 512, 2048};
// The window of features 10 and 11, and the age cap of feature 12.
inline constexpr uint32_t kJfWindow = 16;
inline constexpr uint32_t kJfMaxAge = 2048;
// Names the definition above; a model file carries the set it was trained on.
inline constexpr std::string_view kJfFeatureSet = "jf-features-1";
// Fill's rows (and the model's per-layer scratch) are padded to a multiple of this many experts.
inline constexpr uint32_t kJfExpertBlock = 8;
inline constexpr uint32_t JfFeatureStride(uint32_t experts) {
  return (experts + kJfExpertBlock - 1) / kJfExpertBlock * kJfExpertBlock;
}

class JfFeatureState {
 public:
  // INVALID_ARGUMENT for zero layers, experts or top_k, or top_k > experts.
  static absl::StatusOr<JfFeatureState> Create(uint32_t num_layers, uint32_t experts_per_layer,
                                               uint32_t top_k);

  // One token: experts and weights layer-major (num_layers * top_k), norms one per layer or
  // empty (unreported). The caller has validated ids and sizes (Predictor::Observe does).
  void Observe(std::span<const uint32_t> experts, std::span<const float> weights,
               std::span<const float> norms);
  // A new request starts: clears the per-request signals.
  void NewSequence();
  // Layer's features into `out`, feature-major: feature d of expert e at
  // out[d * JfFeatureStride(experts) + e], and 0 at the padding (e >= experts); `out` holds
  // kJfFeatures * JfFeatureStride(experts) floats. `resident` has one byte per expert of the
  // layer (nonzero: feature 14 is 1).
  void Fill(uint32_t layer, std::span<const uint8_t> resident, std::span<float> out) const;

  uint32_t num_layers() const { return layers_; }
  uint32_t experts_per_layer() const { return experts_; }
  uint32_t top_k() const { return top_k_; }
  uint64_t position() const { return position_; }

  // The state as bytes, and back into a state of the same geometry: INVALID_ARGUMENT for
  // another geometry, DATA_LOSS for truncated or malformed bytes.
  std::string Save() const;
  absl::Status Restore(std::string_view bytes);

 private:
  JfFeatureState(uint32_t layers, uint32_t experts, uint32_t top_k);
  size_t Cell(uint32_t layer, uint32_t expert) const {
    return static_cast<size_t>(layer) * experts_ + expert;
  }
  // The first of layer's kJfHalfLives EMA rows (row h at + h * experts_).
  size_t EmaRow(uint32_t layer) const { return static_cast<size_t>(layer) * kJfHalfLives * stride_; }
  // layer's first entry in the per-cell arrays padded to stride_ (seq_hits_).
  size_t PaddedCell(uint32_t layer, uint32_t expert) const {
    return static_cast<size_t>(layer) * stride_ + expert;
  }
  // Multiplies every EMA by g^pending and zeroes pending (the EMAs are stored scaled up by
  // g^-pending between folds so a token touches only the cells it hit; Fill reads them
  // through the same factor without writing them).
  void FoldAll();

  uint32_t layers_ = 0;
  uint32_t experts_ = 0;
  uint32_t top_k_ = 0;
  uint32_t stride_ = 0;    // JfFeatureStride(experts_): padded rows, the padding always 0
  uint64_t position_ = 0;  // tokens observed in the current sequence
  uint32_t pending_ = 0;   // tokens since the last fold
  double decay_[kJfHalfLives] = {};
  std::vector<float> inv_pow_;   // [h][i] = (1 - g_h) * g_h^-i, i <= kMaxPending
  std::vector<float> fold_pow_;  // [h][i] = g_h^i, i <= kMaxPending
  // [layer][h][stride_]: EMA rows, scaled by g_h^-pending_.
  std::vector<float> hit_ema_;
  std::vector<float> sal_ema_;
  std::vector<uint64_t> last_hit_;  // position + 1 of the last hit in this sequence, 0 = none
  std::vector<uint32_t> seq_hits_;  // [layer][stride_]: hits in this sequence
  // The last kJfWindow tokens of this sequence: per token and layer, top_k experts and
  // saliences (ring, position_ % kJfWindow is the next slot).
  std::vector<uint32_t> ring_experts_;
  std::vector<float> ring_salience_;
  std::vector<float> age_feature_;  // feature 12 by age, 0..kJfMaxAge
};

}  // namespace nq::streamer
