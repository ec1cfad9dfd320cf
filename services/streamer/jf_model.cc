#include "services/streamer/jf_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/streamer/jf_features.h"

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
  ASSIGN_OR_RETURN(g.horizon, MetaUint(header, "horizon", 1 << 20));
  if (g.features != kJfFeatures) {
    return absl::InvalidArgumentError(absl::StrCat("model takes ", g.features, " features, this build computes ",
                                                   kJfFeatures));
  }
  if (g.horizon != kJfHorizon) {
    return absl::InvalidArgumentError(absl::StrCat("model predicts ", g.horizon, " tokens ahead, the streamer plans ",
                                                   kJfHorizon));
  }
  return g;
}

// log(1 + e^x) without overflow for large x.
float Softplus(float x) { return x > 20 ? x : std::log1p(std::exp(x)); }

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
  // Forward reads W_in and W_h transposed: [D][H] and [H_in][H_out].
  m->w_in_t_.resize(m->w_in_.size());
  for (int64_t i = 0; i < H; ++i) {
    for (int64_t d = 0; d < D; ++d) m->w_in_t_[d * H + i] = m->w_in_[i * D + d];
  }
  m->w_h_t_.resize(m->w_h_.size());
  for (int64_t i = 0; i < H; ++i) {
    for (int64_t j = 0; j < H; ++j) m->w_h_t_[j * H + i] = m->w_h_[i * H + j];
  }
  m->h0_.resize(static_cast<size_t>(E) * H);
  m->logits_.resize(static_cast<size_t>(E));
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

// The forward with the hidden width known at compile time: every inner loop runs over H
// contiguous floats (weights stored transposed at load), which the compiler unrolls and
// vectorizes. Shapes as in the header.
template <uint32_t H>
void ForwardH(const JfGeometry& g, const float* emb, const float* w_in_t, const float* b_in, const float* query,
              const float* w_ctx, const float* w_h_t, const float* b_h, const float* w_out, float b_out,
              const float* features, float* out, float* h0, float* logits, float* context) {
  const uint32_t E = g.experts_per_layer, D = g.features, Q = g.queries;
  for (uint32_t e = 0; e < E; ++e) {
    const float* f = features + static_cast<size_t>(e) * D;
    float acc[H];
    for (uint32_t i = 0; i < H; ++i) acc[i] = b_in[i] + emb[static_cast<size_t>(e) * H + i];
    for (uint32_t d = 0; d < D; ++d) {
      const float x = f[d];
      const float* w = w_in_t + static_cast<size_t>(d) * H;
      for (uint32_t i = 0; i < H; ++i) acc[i] += w[i] * x;
    }
    float* h = h0 + static_cast<size_t>(e) * H;
    for (uint32_t i = 0; i < H; ++i) h[i] = acc[i] > 0 ? acc[i] : 0;
  }
  const float inv_sqrt_h = 1.0f / std::sqrt(static_cast<float>(H));
  for (uint32_t q = 0; q < Q; ++q) {
    const float* qv = query + static_cast<size_t>(q) * H;
    float top = -INFINITY;
    for (uint32_t e = 0; e < E; ++e) {
      const float* h = h0 + static_cast<size_t>(e) * H;
      float s = 0;
      for (uint32_t i = 0; i < H; ++i) s += qv[i] * h[i];
      logits[e] = s * inv_sqrt_h;
      top = std::max(top, logits[e]);
    }
    float c[H] = {};
    float total = 0;
    for (uint32_t e = 0; e < E; ++e) {
      const float a = std::exp(logits[e] - top);
      total += a;
      const float* h = h0 + static_cast<size_t>(e) * H;
      for (uint32_t i = 0; i < H; ++i) c[i] += a * h[i];
    }
    for (uint32_t i = 0; i < H; ++i) context[static_cast<size_t>(q) * H + i] = c[i] / total;
  }
  // g = W_ctx concat(c) + b_h: the layer's shared term.
  float gl[H];
  for (uint32_t i = 0; i < H; ++i) {
    const float* w = w_ctx + static_cast<size_t>(i) * Q * H;
    float acc = b_h[i];
    for (uint32_t j = 0; j < Q * H; ++j) acc += w[j] * context[j];
    gl[i] = acc;
  }
  for (uint32_t e = 0; e < E; ++e) {
    const float* h = h0 + static_cast<size_t>(e) * H;
    float acc[H];
    for (uint32_t i = 0; i < H; ++i) acc[i] = gl[i];
    for (uint32_t j = 0; j < H; ++j) {
      const float x = h[j];
      const float* w = w_h_t + static_cast<size_t>(j) * H;
      for (uint32_t i = 0; i < H; ++i) acc[i] += w[i] * x;
    }
    float y = b_out;
    for (uint32_t i = 0; i < H; ++i) y += w_out[i] * (acc[i] > 0 ? acc[i] : 0);
    out[e] = Softplus(y);
  }
}

}  // namespace

void JfModel::Forward(uint32_t layer, std::span<const float> features, std::span<float> out) const {
  const JfGeometry& g = geometry_;
  const float* emb = &emb_[static_cast<size_t>(layer) * g.experts_per_layer * g.hidden];
  auto run = [&](auto forward) {
    forward(g, emb, w_in_t_.data(), b_in_.data(), query_.data(), w_ctx_.data(), w_h_t_.data(), b_h_.data(),
            w_out_.data(), b_out_, features.data(), out.data(), h0_.data(), logits_.data(), context_.data());
  };
  // Load admits only these widths.
  switch (g.hidden) {
    case 8: return run(ForwardH<8>);
    case 16: return run(ForwardH<16>);
    case 32: return run(ForwardH<32>);
  }
}

}  // namespace nq::streamer
