#include "services/model/kv_cache.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::model {

absl::StatusOr<kernels::DType> ParseKvCacheDType(absl::string_view name) {
  if (name == "f32") return kernels::DType::kF32;
  if (name == "bf16") return kernels::DType::kBF16;
  if (name == "fp8") return kernels::DType::kF8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("KV cache dtype \"", name, "\" is not one of f32, bf16, fp8"));
}

namespace {

// An FP8 cache keeps its latent as packed rows of codes and tile scales (kernels/kv_fp8.h) and
// its rope key in BF16; F32 and BF16 caches keep both in their dtype.
kernels::DType LatentStorage(kernels::DType dtype) {
  return dtype == kernels::DType::kF8E4M3 ? kernels::DType::kU8 : dtype;
}
kernels::DType RopeKeyDType(kernels::DType dtype) {
  return dtype == kernels::DType::kF8E4M3 ? kernels::DType::kBF16 : dtype;
}
int64_t LatentRowWidth(const ModelConfig& config, kernels::DType dtype) {
  return dtype == kernels::DType::kF8E4M3 ? kernels::KvFp8RowBytes(config.kv_lora_rank) : config.kv_lora_rank;
}

}  // namespace

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
  if (dtype != kernels::DType::kF32 && dtype != kernels::DType::kBF16 && dtype != kernels::DType::kF8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache dtype must be F32, BF16 or F8_E4M3, got ",
                                                   kernels::DTypeName(dtype)));
  }
  KvCache cache;
  cache.dtype_ = dtype;
  cache.max_tokens_ = max_tokens;
  for (bool indexer : has_indexer) {
    LayerCache layer;
    ASSIGN_OR_RETURN(layer.latent, backend.Allocate(LatentStorage(dtype),
                                                    kernels::Shape{max_tokens, LatentRowWidth(config, dtype)}));
    ASSIGN_OR_RETURN(layer.k_pe,
                     backend.Allocate(RopeKeyDType(dtype), kernels::Shape{max_tokens, config.qk_rope_head_dim}));
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
  const auto latent_element = static_cast<int64_t>(kernels::DTypeSize(LatentStorage(dtype)));
  const auto rope_element = static_cast<int64_t>(kernels::DTypeSize(RopeKeyDType(dtype)));
  int64_t bytes = 0;
  for (bool indexer : has_indexer) {
    bytes += max_tokens * (LatentRowWidth(config, dtype) * latent_element + config.qk_rope_head_dim * rope_element);
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
