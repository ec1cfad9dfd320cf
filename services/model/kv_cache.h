// The KV cache of one sequence: per layer the compressed MLA latent (kv_lora_rank) and the
// rotated shared rope key (qk_rope_head_dim) of every token, plus the DSA indexer keys
// (index_head_dim) for layers that run an indexer. Replicated on every tensor-parallel rank:
// the latent is shared by all heads, so it cannot be split by head.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/model/model_config.h"

namespace nq::model {

struct LayerCache {
  kernels::Tensor latent;  // [max_tokens, kv_lora_rank]
  kernels::Tensor k_pe;    // [max_tokens, qk_rope_head_dim]
  std::optional<kernels::Tensor> index_keys;  // [max_tokens, index_head_dim]
};

class KvCache {
 public:
  // One LayerCache per entry of `has_indexer` (decoder layers, then MTP layers).
  static absl::StatusOr<KvCache> Create(kernels::Backend& backend, const ModelConfig& config,
                                        const std::vector<bool>& has_indexer, int64_t max_tokens);

  LayerCache& layer(size_t i) { return layers_[i]; }
  int64_t max_tokens() const { return max_tokens_; }
  // Tokens whose keys are in the cache; the next forward writes at this position.
  int64_t length() const { return length_; }
  void set_length(int64_t length) { length_ = length; }

 private:
  std::vector<LayerCache> layers_;
  int64_t max_tokens_ = 0;
  int64_t length_ = 0;
};

}  // namespace nq::model
