#include "services/model/kv_cache.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::model {

absl::StatusOr<kernels::DType> ParseKvCacheDType(absl::string_view name) {
  if (name == "f32") return kernels::DType::kF32;
  if (name == "bf16") return kernels::DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("KV cache dtype \"", name, "\" is not one of f32, bf16"));
}

std::vector<bool> KvCacheIndexerLayers(const ModelConfig& c) {
  std::vector<bool> has;
  for (int64_t l = 0; l < c.num_hidden_layers + c.num_nextn_predict_layers; ++l) {
    const bool mtp = l >= c.num_hidden_layers;
    has.push_back(c.indexer.enabled && (mtp || c.indexer.kinds[l] == IndexerKind::kFull));
  }
  return has;
}

absl::StatusOr<KvCache> KvCache::Create(kernels::Backend& backend, const ModelConfig& config,
                                        const std::vector<bool>& has_indexer, int64_t max_tokens,
                                        kernels::DType dtype) {
  if (max_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache of ", max_tokens, " tokens"));
  }
  if (dtype != kernels::DType::kF32 && dtype != kernels::DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache dtype must be F32 or BF16, got ",
                                                   kernels::DTypeName(dtype)));
  }
  KvCache cache;
  cache.dtype_ = dtype;
  cache.max_tokens_ = max_tokens;
  for (bool indexer : has_indexer) {
    LayerCache layer;
    ASSIGN_OR_RETURN(layer.latent,
                     backend.Allocate(dtype, kernels::Shape{max_tokens, config.kv_lora_rank}));
    ASSIGN_OR_RETURN(layer.k_pe,
                     backend.Allocate(dtype, kernels::Shape{max_tokens, config.qk_rope_head_dim}));
    if (indexer) {
      ASSIGN_OR_RETURN(layer.index_keys,
                       backend.Allocate(kernels::DType::kF32,
                                        kernels::Shape{max_tokens, config.indexer.head_dim}));
    }
    cache.layers_.push_back(std::move(layer));
  }
  return cache;
}

int64_t KvCache::BytesFor(const ModelConfig& config, const std::vector<bool>& has_indexer, int64_t max_tokens,
                          kernels::DType dtype) {
  const auto element = static_cast<int64_t>(kernels::DTypeSize(dtype));
  int64_t bytes = 0;
  for (bool indexer : has_indexer) {
    bytes += max_tokens * (config.kv_lora_rank + config.qk_rope_head_dim) * element;
    if (indexer) bytes += max_tokens * config.indexer.head_dim * static_cast<int64_t>(sizeof(float));
  }
  return bytes;
}

int64_t KvCache::bytes() const {
  int64_t bytes = 0;
  for (const LayerCache& layer : layers_) {
    bytes += static_cast<int64_t>(layer.latent.nbytes() + layer.k_pe.nbytes());
    if (layer.index_keys.has_value()) bytes += static_cast<int64_t>(layer.index_keys->nbytes());
  }
  return bytes;
}

}  // namespace nq::model
