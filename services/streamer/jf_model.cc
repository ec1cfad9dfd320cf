#include "services/streamer/jf_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/cpu_features.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/streamer/jf_features.h"
#include "services/streamer/jf_math.h"

namespace nq::streamer {
namespace {

// Bounds that keep a hostile header from asking for absurd scratch; GLM-5 is 75 x 256.
constexpr uint32_t kMaxLayers = 1024;
constexpr uint32_t kMaxExperts = 65535;
constexpr uint32_t kMaxHidden = 32;
constexpr uint32_t kMaxQueries = 16;

absl::StatusOr<std::string> Meta(const model::Header& header, const std::string& key) {
  auto it = header.metadata.find(key);
  if (it == header.metadata.end()) return absl::InvalidArgumentError(absl::StrCat("metadata has no \"", key, "\""));
  return it->second;
}

absl::StatusOr<uint32_t> MetaUint(const model::Header& header, const std::string& key, uint32_t max) {
  ASSIGN_OR_RETURN(std::string text, Meta(header, key));
  uint32_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value == 0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata \"", key, "\" = \"", text, "\" is not an integer in [1, ", max, "]"));
  }
  return value;
}

absl::StatusOr<std::vector<float>> Tensor(const model::SafetensorsFile& file, const std::string& name,
                                          std::vector<int64_t> shape) {
  ASSIGN_OR_RETURN(model::TensorView view, file.Find(name));
  if (view.dtype != model::DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " is not F32"));
  }
  if (!std::equal(view.shape.begin(), view.shape.end(), shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape [",
                                                   absl::StrJoin(view.shape, ", "), "], expected [",
                                                   absl::StrJoin(shape, ", "), "]"));
  }
  std::vector<float> values(view.numel());
  std::memcpy(values.data(), view.data.data(), values.size() * sizeof(float));
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has a non-finite value at ", i));
    }
  }
  return values;
}

absl::StatusOr<JfGeometry> ReadGeometry(const model::Header& header) {
  ASSIGN_OR_RETURN(std::string format, Meta(header, "format"));
  if (format != kJfFormat) {
    return absl::InvalidArgumentError(absl::StrCat("format is \"", format, "\", expected \"", kJfFormat, "\""));
  }
  ASSIGN_OR_RETURN(std::string version, Meta(header, "version"));
  if (version != std::to_string(kJfVersion)) {
    return absl::InvalidArgumentError(absl::StrCat("version ", version, " (this build reads ", kJfVersion, ")"));
  }
  ASSIGN_OR_RETURN(std::string feature_set, Meta(header, "feature_set"));
  if (feature_set != kJfFeatureSet) {
    return absl::InvalidArgumentError(absl::StrCat("trained on feature set \"", feature_set,
                                                   "\", this build computes \"", std::string(kJfFeatureSet), "\""));
  }
  JfGeometry g;
  ASSIGN_OR_RETURN(g.num_layers, MetaUint(header, "num_layers", kMaxLayers));
  ASSIGN_OR_RETURN(g.experts_per_layer, MetaUint(header, "experts_per_layer", kMaxExperts));
  ASSIGN_OR_RETURN(g.top_k, MetaUint(header, "top_k", g.experts_per_layer));
  ASSIGN_OR_RETURN(g.features, MetaUint(header, "features", 1024));
  ASSIGN_OR_RETURN(g.hidden, MetaUint(header, "hidden", kMaxHidden));
  if (g.hidden != 8 && g.hidden != 16 && g.hidden != 32) {
    return absl::InvalidArgumentError(absl::StrCat("hidden width ", g.hidden, " (this build runs 8, 16 or 32)"));
  }
  ASSIGN_OR_RETURN(g.queries, MetaUint(header, "queries", kMaxQueries));
  ASSIGN_OR_RETURN(g.horizon, MetaUint(header, "horizon", kJfMaxHorizon));
  if (g.features != kJfFeatures) {
    return absl::InvalidArgumentError(absl::StrCat("model takes ", g.features, " features, this build computes ",
                                                   kJfFeatures));
  }
  return g;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const JfModel>> JfModel::Load(const std::string& path) {
  const std::string context = "predictor file " + path;
  absl::StatusOr<model::SafetensorsFile> file = model::SafetensorsFile::Open(path);
  if (!file.ok()) return Annotate(file.status(), context);
  absl::StatusOr<JfGeometry> geometry = ReadGeometry(file->header());
  if (!geometry.ok()) return Annotate(geometry.status(), context);
  std::shared_ptr<JfModel> m(new JfModel());
  m->geometry_ = *geometry;
  m->path_ = path;
  if (auto it = file->header().metadata.find("hysteresis_margin"); it != file->header().metadata.end()) {
    float margin = 0;
    const auto [end, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), margin);
    if (ec != std::errc() || end != it->second.data() + it->second.size() || !(margin >= 0) || !std::isfinite(margin)) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": metadata \"hysteresis_margin\" = \"", it->second,
                                                     "\" is not a finite number >= 0"));
    }
    m->hysteresis_margin_ = margin;
  }
  const JfGeometry& g = m->geometry_;
  const int64_t L = g.num_layers, E = g.experts_per_layer, H = g.hidden, D = g.features, Q = g.queries;
  struct Want {
    const char* name;
    std::vector<int64_t> shape;
    std::vector<float>* into;
  };
  std::vector<float> b_out;
  const Want wants[] = {{"emb", {L, E, H}, &m->emb_},   {"w_in", {H, D}, &m->w_in_},
                        {"b_in", {H}, &m->b_in_},       {"query", {Q, H}, &m->query_},
                        {"w_ctx", {H, Q * H}, &m->w_ctx_}, {"w_h", {H, H}, &m->w_h_},
                        {"b_h", {H}, &m->b_h_},         {"w_out", {H}, &m->w_out_},
                        {"b_out", {1}, &b_out}};
  for (const Want& want : wants) {
    absl::StatusOr<std::vector<float>> values = Tensor(*file, want.name, want.shape);
    if (!values.ok()) return Annotate(values.status(), context);
    *want.into = *std::move(values);
  }
  if (file->header().tensors.size() != std::size(wants)) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", file->header().tensors.size(),
                                                   " tensors, a jF model has ", std::size(wants)));
  }
  m->b_out_ = b_out[0];
  // Forward reads the embedding per layer feature-major, [L][H][S], the padding 0.
  const int64_t S = JfFeatureStride(g.experts_per_layer);
  m->emb_t_.assign(static_cast<size_t>(L * H * S), 0.0f);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < H; ++i) m->emb_t_[(l * H + i) * S + e] = m->emb_[(l * E + e) * H + i];
    }
  }
  m->emb_.clear();
  m->emb_.shrink_to_fit();
  m->h0_.resize(static_cast<size_t>(S) * H);
  m->scratch_.resize(static_cast<size_t>(S));
  m->context_.resize(static_cast<size_t>(Q) * H);
  return std::shared_ptr<const JfModel>(std::move(m));
}

absl::Status JfModel::CheckGeometry(uint32_t num_layers, uint32_t experts_per_layer, uint32_t top_k) const {
  if (num_layers != geometry_.num_layers || experts_per_layer != geometry_.experts_per_layer ||
      top_k != geometry_.top_k) {
    return absl::FailedPreconditionError(
        absl::StrCat("predictor file ", path_, " was trained for ", geometry_.num_layers, " MoE layers x ",
                     geometry_.experts_per_layer, " experts, top-", geometry_.top_k, "; the model served has ",
                     num_layers, " x ", experts_per_layer, ", top-", top_k));
  }
  return absl::OkStatus();
}

namespace {

constexpr uint32_t kB = kJfExpertBlock;

// The forward with the hidden width known at compile time, over the layer's experts in blocks
// of kB: every inner loop runs over kB contiguous floats of one row (features and activations
// are feature-major, [row][S] with S = JfFeatureStride(E)), which the compiler vectorizes at
// -O2; exp and softplus are jf_math.h's branch-free ones. Each activation is summed in the same
// fixed order (bias, embedding, then the features in order, as the scalar version before it). Padding experts
// (E <= e < S) are computed and then ignored: they take no part in the attention and get no
// output. Shapes as in the header; emb is this layer's [H][S] slice.
// kRows rows of an activation are computed together (H is a multiple of it): as many kB-wide
// accumulators as the vector registers hold (4 x 2 of SSE2's 16, 8 x 1 of AVX2's 16).
template <uint32_t H, uint32_t kRows>
void ForwardH(const JfGeometry& g, const float* __restrict emb, const float* __restrict w_in,
              const float* __restrict b_in, const float* __restrict query, const float* __restrict w_ctx,
              const float* __restrict w_h, const float* __restrict b_h, const float* __restrict w_out, float b_out,
              const float* __restrict features, float* __restrict out, float* __restrict h0,
              float* __restrict scratch, float* __restrict context) {
  const uint32_t E = g.experts_per_layer, D = g.features, Q = g.queries, S = JfFeatureStride(E);
  // h0[i][e] = relu(b_in[i] + emb[i][e] + sum_d w_in[i][d] f[d][e]), kRows rows of h0 at a time:
  // their kRows x kB sums are independent chains the core overlaps (one row's sum over d is a
  // chain of dependent adds), and each feature block is loaded once for all of them.
  for (uint32_t b = 0; b < S; b += kB) {
    for (uint32_t i0 = 0; i0 < H; i0 += kRows) {
      float acc[kRows][kB];
#pragma GCC unroll 8
      for (uint32_t r = 0; r < kRows; ++r) {
        for (uint32_t j = 0; j < kB; ++j) acc[r][j] = b_in[i0 + r] + emb[static_cast<size_t>(i0 + r) * S + b + j];
      }
      for (uint32_t d = 0; d < D; ++d) {
        const float* f = features + static_cast<size_t>(d) * S + b;
#pragma GCC unroll 8
        for (uint32_t r = 0; r < kRows; ++r) {
          const float w = w_in[static_cast<size_t>(i0 + r) * D + d];
          for (uint32_t j = 0; j < kB; ++j) acc[r][j] += w * f[j];
        }
      }
#pragma GCC unroll 8
      for (uint32_t r = 0; r < kRows; ++r) {
        float* h = h0 + static_cast<size_t>(i0 + r) * S + b;
        for (uint32_t j = 0; j < kB; ++j) h[j] = acc[r][j] > 0 ? acc[r][j] : 0.0f;
      }
    }
  }
  // Pooling: c_q = softmax_e(query[q] . h0[e] / sqrt(H)) weighted sum of h0[e], real experts only.
  const float inv_sqrt_h = 1.0f / std::sqrt(static_cast<float>(H));
  float* logits = scratch;
  for (uint32_t q = 0; q < Q; ++q) {
    const float* qv = query + static_cast<size_t>(q) * H;
    for (uint32_t b = 0; b < S; b += kB) {
      float s[kB] = {};
      for (uint32_t i = 0; i < H; ++i) {
        const float* h = h0 + static_cast<size_t>(i) * S + b;
        for (uint32_t j = 0; j < kB; ++j) s[j] += qv[i] * h[j];
      }
      for (uint32_t j = 0; j < kB; ++j) logits[b + j] = s[j] * inv_sqrt_h;
    }
    // The largest logit: lane maxima over whole blocks, then the rest (max is exact in any order).
    float top_lanes[kB];
    for (uint32_t j = 0; j < kB; ++j) top_lanes[j] = -INFINITY;
    const uint32_t whole = E / kB * kB;
    for (uint32_t b = 0; b < whole; b += kB) {
      for (uint32_t j = 0; j < kB; ++j) top_lanes[j] = logits[b + j] > top_lanes[j] ? logits[b + j] : top_lanes[j];
    }
    float top = -INFINITY;
    for (float lane : top_lanes) top = std::max(top, lane);
    for (uint32_t e = whole; e < E; ++e) top = std::max(top, logits[e]);
    for (uint32_t b = 0; b < S; b += kB) {
      for (uint32_t j = 0; j < kB; ++j) logits[b + j] = ExpClamped(logits[b + j] - top);
    }
    for (uint32_t e = E; e < S; ++e) logits[e] = 0.0f;  // the padding has no weight
    float lanes[kB] = {};
    for (uint32_t b = 0; b < S; b += kB) {
      for (uint32_t j = 0; j < kB; ++j) lanes[j] += logits[b + j];
    }
    float total = 0;
    for (float lane : lanes) total += lane;
    for (uint32_t i0 = 0; i0 < H; i0 += kRows) {  // kRows independent lane sums at a time
      float c[kRows][kB] = {};
      for (uint32_t b = 0; b < S; b += kB) {
#pragma GCC unroll 8
        for (uint32_t r = 0; r < kRows; ++r) {
          const float* h = h0 + static_cast<size_t>(i0 + r) * S + b;
          for (uint32_t j = 0; j < kB; ++j) c[r][j] += logits[b + j] * h[j];
        }
      }
      for (uint32_t r = 0; r < kRows; ++r) {
        float sum = 0;
        for (float lane : c[r]) sum += lane;
        context[static_cast<size_t>(q) * H + i0 + r] = sum / total;
      }
    }
  }
  // g = W_ctx concat(c) + b_h: the layer's shared term.
  float gl[H];
  for (uint32_t i = 0; i < H; ++i) {
    const float* w = w_ctx + static_cast<size_t>(i) * Q * H;
    float acc = b_h[i];
    for (uint32_t j = 0; j < Q * H; ++j) acc += w[j] * context[j];
    gl[i] = acc;
  }
  // out[e] = softplus(b_out + sum_i w_out[i] relu(g[i] + sum_j w_h[i][j] h0[j][e])).
  float* y = scratch;  // the logits are spent
  for (uint32_t b = 0; b < S; b += kB) {
    float yb[kB];
    for (uint32_t j = 0; j < kB; ++j) yb[j] = b_out;
    for (uint32_t i0 = 0; i0 < H; i0 += kRows) {  // kRows rows of h1 at a time, as h0's
      float acc[kRows][kB];
#pragma GCC unroll 8
      for (uint32_t r = 0; r < kRows; ++r) {
        for (uint32_t j = 0; j < kB; ++j) acc[r][j] = gl[i0 + r];
      }
      for (uint32_t k = 0; k < H; ++k) {
        const float* h = h0 + static_cast<size_t>(k) * S + b;
#pragma GCC unroll 8
        for (uint32_t r = 0; r < kRows; ++r) {
          const float w = w_h[static_cast<size_t>(i0 + r) * H + k];
          for (uint32_t j = 0; j < kB; ++j) acc[r][j] += w * h[j];
        }
      }
      for (uint32_t r = 0; r < kRows; ++r) {  // in row order, as one row at a time summed them
        for (uint32_t j = 0; j < kB; ++j) yb[j] += w_out[i0 + r] * (acc[r][j] > 0 ? acc[r][j] : 0.0f);
      }
    }
    for (uint32_t j = 0; j < kB; ++j) y[b + j] = Softplus(yb[j]);
  }
  std::copy(y, y + E, out);
}

#if defined(__x86_64__)
// The same forward compiled for AVX2 (8 floats a vector): flatten inlines ForwardH and jf_math.h
// into it. Without FMA (no "fma" target) every product and sum is rounded as in the SSE2
// build, in the same order per lane, so both give the same bits; only the width differs.
template <uint32_t H>
__attribute__((target("avx2"), flatten)) void ForwardAvx2(
    const JfGeometry& g, const float* __restrict emb, const float* __restrict w_in, const float* __restrict b_in,
    const float* __restrict query, const float* __restrict w_ctx, const float* __restrict w_h,
    const float* __restrict b_h, const float* __restrict w_out, float b_out, const float* __restrict features,
    float* __restrict out, float* __restrict h0, float* __restrict scratch, float* __restrict context) {
  ForwardH<H, 8>(g, emb, w_in, b_in, query, w_ctx, w_h, b_h, w_out, b_out, features, out, h0, scratch, context);
}
#endif

}  // namespace

void JfModel::Forward(uint32_t layer, std::span<const float> features, std::span<float> out, Isa isa) const {
  const JfGeometry& g = geometry_;
  const float* emb = &emb_t_[static_cast<size_t>(layer) * g.hidden * JfFeatureStride(g.experts_per_layer)];
  auto run = [&](auto forward) {
    forward(g, emb, w_in_.data(), b_in_.data(), query_.data(), w_ctx_.data(), w_h_.data(), b_h_.data(),
            w_out_.data(), b_out_, features.data(), out.data(), h0_.data(), scratch_.data(), context_.data());
  };
#if defined(__x86_64__)
  if (isa == Isa::kBest && CpuHasAvx2()) {
    switch (g.hidden) {
      case 8: return run(ForwardAvx2<8>);
      case 16: return run(ForwardAvx2<16>);
      case 32: return run(ForwardAvx2<32>);
    }
  }
#endif
  // Load admits only these widths.
  switch (g.hidden) {
    case 8: return run(ForwardH<8, 4>);
    case 16: return run(ForwardH<16, 4>);
    case 32: return run(ForwardH<32, 4>);
  }
}

}  // namespace nq::streamer
