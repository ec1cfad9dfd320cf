#include "services/model/kv_cache.h"

#include <algorithm>
#include <cstdint>

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

// --- Lending the free room (kv_loan.h).

kernels::Tensor* KvCache::tensor(size_t layer, KvCachePart part) {
  return const_cast<kernels::Tensor*>(static_cast<const KvCache*>(this)->tensor(layer, part));
}

const kernels::Tensor* KvCache::tensor(size_t layer, KvCachePart part) const {
  if (layer >= layers_.size()) return nullptr;
  const LayerCache& l = layers_[layer];
  switch (part) {
    case KvCachePart::kLatent:
      return &l.latent;
    case KvCachePart::kRopeKey:
      return &l.k_pe;
    case KvCachePart::kIndexKeys:
      return l.index_keys.has_value() ? &*l.index_keys : nullptr;
  }
  return nullptr;
}

std::vector<KvCacheRange> KvCache::FreeRoom(int64_t from_token) const {
  std::vector<KvCacheRange> room;
  if (from_token < 0 || from_token >= max_tokens_) return room;
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    for (KvCachePart part : {KvCachePart::kLatent, KvCachePart::kRopeKey, KvCachePart::kIndexKeys}) {
      const kernels::Tensor* t = tensor(layer, part);
      if (t == nullptr) continue;
      // Every cache tensor is [max_tokens, row], row-major: row r is bytes [r * row, (r + 1) * row).
      const size_t row_bytes = t->nbytes() / static_cast<size_t>(max_tokens_);
      const size_t offset = static_cast<size_t>(from_token) * row_bytes;
      room.push_back({.cache_layer = layer, .part = part, .offset = offset, .bytes = t->nbytes() - offset});
    }
  }
  return room;
}

std::vector<KvCacheRange> KvCache::Carve(int64_t from_token, int64_t record_bytes, int64_t max_records) const {
  std::vector<KvCacheRange> pieces;
  if (record_bytes <= 0 || max_records <= 0) return pieces;
  const size_t record = static_cast<size_t>(record_bytes);
  for (const KvCacheRange& free : FreeRoom(from_token)) {
    // Aligned by address, not by offset: the tensor's own alignment is the backend's business.
    const uintptr_t base = reinterpret_cast<uintptr_t>(tensor(free.cache_layer, free.part)->data());
    size_t at = free.offset;
    const size_t end = free.offset + free.bytes;
    while (static_cast<int64_t>(pieces.size()) < max_records) {
      const size_t skew = (base + at) % kKvLoanAlign;
      if (skew != 0) at += kKvLoanAlign - skew;
      if (at > end || end - at < record) break;
      pieces.push_back({.cache_layer = free.cache_layer, .part = free.part, .offset = at, .bytes = record});
      at += record;
    }
  }
  return pieces;
}

int64_t KvCache::LendableRecords(int64_t from_token, int64_t record_bytes, int64_t max_records) const {
  return static_cast<int64_t>(Carve(from_token, record_bytes, max_records).size());
}

absl::StatusOr<KvLoan> KvCache::Lend(int64_t from_token, int64_t record_bytes, int64_t max_records) {
  if (record_bytes <= 0 || max_records < 0 || from_token < 0 || from_token > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache loan of up to ", max_records, " records of ",
                                                   record_bytes, " bytes from row ", from_token, " of ", max_tokens_,
                                                   " (want positive records past row 0 up to the cache's end)"));
  }
  if (loan_->lent_from.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("KV cache: ", loan_->records, " records from row ",
                                                      *loan_->lent_from, " are lent already (one loan at a time)"));
  }
  if (from_token < length_) {
    return absl::FailedPreconditionError(absl::StrCat("KV cache: rows below ", length_,
                                                      " are live; a loan from row ", from_token, " would overlap them"));
  }
  std::vector<KvLentRecord> records;
  for (const KvCacheRange& piece : Carve(from_token, record_bytes, max_records)) {
    records.push_back({.tensor = tensor(piece.cache_layer, piece.part), .range = piece});
  }
  if (records.empty()) return KvLoan();
  loan_->lent_from = from_token;
  loan_->records = static_cast<int64_t>(records.size());
  return KvLoan(loan_, from_token, std::move(records));
}

absl::Status KvCache::CheckWritable(int64_t first_row, int64_t rows, absl::string_view what) const {
  if (!loan_->lent_from.has_value() || rows <= 0 || first_row + rows <= *loan_->lent_from) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": rows [", first_row, ", ", first_row + rows,
                                                    ") of the KV cache reach rows lent from ", *loan_->lent_from,
                                                    " to a layer-major prefill's expert slots (", loan_->records,
                                                    " records); the loan must be returned first"));
}

}  // namespace nq::model
