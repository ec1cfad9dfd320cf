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

}  // namespace nq::model
