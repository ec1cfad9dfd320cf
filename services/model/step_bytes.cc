// Model::DecodeStepBytes and Model::RoutedExpertStepBytes: the bytes a decode step must read,
// the numerator of the roofline floor nq bench-decode reports (issue #13).
#include <algorithm>

#include "services/model/model.h"

namespace nq::model {
namespace {

int64_t Bytes(const kernels::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }
int64_t Bytes(const std::optional<kernels::Tensor>& t) { return t.has_value() ? Bytes(*t) : 0; }
int64_t Bytes(const Matrix& m) { return static_cast<int64_t>(m.nbytes()); }  // values and block scales
int64_t Bytes(const std::optional<Matrix>& m) { return m.has_value() ? Bytes(*m) : 0; }
int64_t Bytes(const MlpWeights& w) { return Bytes(w.gate_up) + Bytes(w.down); }

// Every weight of a decoder block but its routed experts.
int64_t LayerWeightBytes(const LayerWeights& w) {
  const AttentionWeights& a = w.attention;
  int64_t bytes = Bytes(w.input_norm) + Bytes(w.post_attention_norm) + Bytes(a.q_a) + Bytes(a.q_a_norm) +
                  Bytes(a.q_nope) + Bytes(a.q_pe) + Bytes(a.kv_a) + Bytes(a.k_pe_proj) + Bytes(a.kv_a_norm) +
                  Bytes(a.w_uk) + Bytes(a.w_uv) + Bytes(a.o_proj);
  if (a.indexer.has_value()) {
    const IndexerWeights& ix = *a.indexer;
    bytes += Bytes(ix.wq_b) + Bytes(ix.wk) + Bytes(ix.k_norm_weight) + Bytes(ix.k_norm_bias) + Bytes(ix.weights_proj);
  }
  if (w.dense.has_value()) bytes += Bytes(*w.dense);
  if (w.moe.has_value()) {
    bytes += Bytes(w.moe->router_device) + Bytes(w.moe->bias_device);
    if (w.moe->shared.has_value()) bytes += Bytes(*w.moe->shared);
  }
  return bytes;
}

}  // namespace

int64_t Model::DecodeStepBytes(int64_t context) const {
  const ModelConfig& c = config_;
  int64_t bytes = Bytes(weights_.final_norm) + Bytes(weights_.lm_head);
  bytes += c.vocab_size > 0 ? Bytes(weights_.embed) / c.vocab_size : 0;  // one row
  const int64_t keys = context + 1;  // the new token sees itself
  // A cached token's latent and rope key as stored (an FP8 cache: packed latent rows, BF16 rope).
  const LayerCache& any = cache_.layer(0);
  const int64_t row_bytes = static_cast<int64_t>(any.latent.nbytes() + any.k_pe.nbytes()) / cache_.max_tokens();
  const int64_t attended = c.indexer.enabled ? std::min<int64_t>(keys, c.indexer.topk) : keys;
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    const LayerWeights& w = weights_.layers[l];
    bytes += LayerWeightBytes(w);
    bytes += attended * row_bytes;
    if (w.attention.indexer.has_value()) bytes += keys * c.indexer.head_dim * static_cast<int64_t>(sizeof(float));
  }
  return bytes;
}

int64_t Model::RoutedExpertStepBytes(int64_t layer, std::span<const int32_t> experts) const {
  if (layer < 0 || layer >= static_cast<int64_t>(weights_.layers.size())) return 0;
  const LayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  if (!w.moe.has_value()) return 0;
  const int64_t E = config_.n_routed_experts;
  std::vector<int32_t> distinct(experts.begin(), experts.end());
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  int64_t bytes = 0;
  if (w.moe->packed.has_value()) {
    const PackedExperts& p = *w.moe->packed;
    for (int32_t e : distinct) {
      bytes += p.packed_bytes / E;
      const bool four_bit = !p.static_slots.empty() && e >= 0 && e < E && p.static_slots[static_cast<size_t>(e)] >= 0;
      if (four_bit) bytes += p.record_bytes;
    }
  } else if (w.moe->nvfp4.has_value()) {
    // Every expert of an NVFP4 layer has the same codes, scales and globals: an equal share.
    bytes += static_cast<int64_t>(distinct.size()) * (w.moe->nvfp4->bytes / E);
  } else {
    for (int32_t e : distinct) {
      if (e >= 0 && e < static_cast<int32_t>(w.moe->experts.size())) bytes += Bytes(w.moe->experts[static_cast<size_t>(e)]);
    }
  }
  return bytes;
}

}  // namespace nq::model
