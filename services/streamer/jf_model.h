// The learned predictor jF (issue #21): scores every expert of a layer jointly for its
// expected hits in the next `horizon` tokens (the file says how many), from the features of
// jf_features.h.
//
// For layer l with features F [E, D] (D = kJfFeatures):
//   h0[e]  = relu(W_in F[e] + b_in + emb[l, e])               [E, H]  per-expert embedding
//   a_q    = softmax_e(query[q] . h0[e] / sqrt(H))            Q pooling queries attend over
//   c_q    = sum_e a_q[e] h0[e]                                the layer's experts
//   g      = W_ctx concat(c_0 .. c_{Q-1})                     [H]     the layer's context
//   h1[e]  = relu(W_h h0[e] + g + b_h)                        [E, H]
//   out[e] = softplus(w_out . h1[e] + b_out)                  expected hits in the horizon
// Attention through Q learned queries (not expert-to-expert) keeps a layer O(E * H * (D + H
// + Q)): at GLM-5 scale (75 x 256, H = 16, Q = 2) about 11 M multiply-adds per refresh. H is
// 8, 16 or 32 (compiled widths: the inner loops vectorize).
//
// File: safetensors, float32 tensors emb [L, E, H], w_in [H, D], b_in [H], query [Q, H],
// w_ctx [H, Q*H], w_h [H, H], b_h [H], w_out [H], b_out [1]; metadata (all strings):
// "format" = "nq-jf", "version" = "1", "feature_set" = kJfFeatureSet, "num_layers",
// "experts_per_layer", "top_k", "features", "hidden", "queries", "horizon", and optionally
// "hysteresis_margin" (a number >= 0: the margin to serve this model with). Written by
// scripts/predictor/train_jf.py (and jf_reference.py for test fixtures).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::streamer {

// The horizon the training script used before it took --horizon (the seed's), and the
// longest a file may name. The streamer scores in share units, so any horizon serves; which
// one plans best is measured (bench/README.md, "The horizon jF is trained for").
inline constexpr uint32_t kJfHorizon = 64;
inline constexpr uint32_t kJfMaxHorizon = 4096;
inline constexpr char kJfFormat[] = "nq-jf";
inline constexpr uint32_t kJfVersion = 1;
// The hysteresis margin jF is served and replayed with when --hysteresis is not given and the
// file carries none (metadata "hysteresis_margin"). jF's scores are its expected hits in share
// units, spread differently from v0's EMA shares, so v0's default margin (2.0) starves it of
// loads; this value is the best of the replay sweep in bench/README.md ("jF's hysteresis
// margin").
inline constexpr float kJfDefaultMargin = 0.05f;

struct JfGeometry {
  uint32_t num_layers = 0;
  uint32_t experts_per_layer = 0;
  uint32_t top_k = 0;
  uint32_t features = 0;
  uint32_t hidden = 0;
  uint32_t queries = 0;
  uint32_t horizon = 0;
};

class JfModel {
 public:
  // Reads and validates a model file. NOT_FOUND for a missing file; the safetensors parser's
  // DATA_LOSS / INVALID_ARGUMENT for a truncated or malformed one; INVALID_ARGUMENT naming
  // the key or tensor for a wrong format, version, feature set, geometry, shape, dtype or a
  // non-finite weight. Every message starts with "predictor file <path>".
  static absl::StatusOr<std::shared_ptr<const JfModel>> Load(const std::string& path);

  // FAILED_PRECONDITION naming both geometries when the model was trained for another
  // (layers, experts, top_k): the streamer refuses such a file.
  absl::Status CheckGeometry(uint32_t num_layers, uint32_t experts_per_layer, uint32_t top_k) const;

  // Expected hits in the next `horizon` tokens of every expert of `layer`: `features` is
  // JfFeatureState::Fill's feature-major layout (features x JfFeatureStride(experts)), `out`
  // one value per expert. Allocates nothing (the scratch is sized at Load; not thread-safe
  // through it: one caller at a time). kBest runs the widest vector build the CPU has (AVX2 on
  // x86-64), kPortable the baseline one; both give the same bits (jf_model.cc).
  enum class Isa { kBest, kPortable };
  void Forward(uint32_t layer, std::span<const float> features, std::span<float> out, Isa isa = Isa::kBest) const;

  const JfGeometry& geometry() const { return geometry_; }
  // The file's "hysteresis_margin", else kJfDefaultMargin.
  float hysteresis_margin() const { return hysteresis_margin_; }
  const std::string& path() const { return path_; }

 private:
  JfModel() = default;

  JfGeometry geometry_;
  std::string path_;
  std::vector<float> emb_, w_in_, b_in_, query_, w_ctx_, w_h_, b_h_, w_out_;
  std::vector<float> emb_t_;  // emb as Forward reads it: [L][H][JfFeatureStride(E)]
  float b_out_ = 0;
  float hysteresis_margin_ = kJfDefaultMargin;
  // Forward's scratch: h0 [H][S], attention weights then outputs [S], contexts [Q][H].
  mutable std::vector<float> h0_, scratch_, context_;
};

}  // namespace nq::streamer
