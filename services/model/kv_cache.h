// The KV cache of one sequence: per layer the compressed MLA latent (kv_lora_rank) and the
// rotated shared rope key (qk_rope_head_dim) of every token, plus the DSA indexer keys
// (index_head_dim) for layers that run an indexer. Replicated on every tensor-parallel rank:
// the latent is shared by all heads, so it cannot be split by head.
//
// The latent and rope key are stored in the cache's dtype: F32, or BF16 (half the memory, so
// twice the context per byte; issue #13), or FP8: the latent as packed E4M3 rows with a float32
// scale per 128 values (kernels/kv_fp8.h, U8 tensors), the rope key in BF16 (656 bytes a token
// at DeepSeek-V3's 512 + 64, against 1152 in BF16; the CPU backend only, so far). The model
// computes them in F32 and Backend::WriteRows rounds them into the cache; Backend::MlaAttention
// widens them back as it reads. The indexer keys stay F32: the DSA top-k compares scores, and a
// rounded key can flip which key is kept.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "services/model/kv_loan.h"
#include "services/model/model_config.h"

namespace nq::model {

struct LayerCache {
  kernels::Tensor latent;  // [max_tokens, kv_lora_rank] of the cache's dtype; FP8: U8 [max_tokens, KvFp8RowBytes]
  kernels::Tensor k_pe;    // [max_tokens, qk_rope_head_dim], the cache's dtype; FP8: BF16
  std::optional<kernels::Tensor> index_keys;  // [max_tokens, index_head_dim], always F32
};

// The --kv_cache_dtype values: "f32", "bf16" or "fp8" (F8_E4M3). INVALID_ARGUMENT names the
// accepted values.
absl::StatusOr<kernels::DType> ParseKvCacheDType(absl::string_view name);

// Which cache layers keep DSA indexer keys: decoder layers with a full indexer, then every MTP
// layer the config names (a model that loads fewer MTP layers keeps a prefix).
std::vector<bool> KvCacheIndexerLayers(const ModelConfig& config);

class KvCache {
 public:
  // One LayerCache per entry of `has_indexer` (decoder layers, then MTP layers). `dtype`, of the
  // latent and rope key: F32, BF16 or F8_E4M3 (INVALID_ARGUMENT otherwise).
  static absl::StatusOr<KvCache> Create(kernels::Backend& backend, const ModelConfig& config,
                                        const std::vector<bool>& has_indexer, int64_t max_tokens,
                                        kernels::DType dtype);

  // Bytes Create allocates for the same arguments (a worker's device-fit check, before loading).
  static int64_t BytesFor(const ModelConfig& config, const std::vector<bool>& has_indexer, int64_t max_tokens,
                          kernels::DType dtype);
  // Bytes this cache holds.
  int64_t bytes() const;

  LayerCache& layer(size_t i) { return layers_[i]; }
  const LayerCache& layer(size_t i) const { return layers_[i]; }
  kernels::DType dtype() const { return dtype_; }
  int64_t max_tokens() const { return max_tokens_; }
  // Tokens whose keys are in the cache; the next forward writes at this position.
  int64_t length() const { return length_; }
  void set_length(int64_t length) { length_ = length; }
  size_t num_layers() const { return layers_.size(); }

  // --- Lending the free room (kv_loan.h, issue #23).
  // `part` of cache layer `layer`; null for indexer keys a layer does not keep.
  kernels::Tensor* tensor(size_t layer, KvCachePart part);
  const kernels::Tensor* tensor(size_t layer, KvCachePart part) const;
  // Rows [from_token, max_tokens) of every cache tensor as bytes, one range per tensor with room
  // (none past max_tokens): cache layers in order, in each the latent, rope key, indexer keys.
  std::vector<KvCacheRange> FreeRoom(int64_t from_token) const;
  // Lends up to `max_records` pieces of `record_bytes` bytes, each at an address aligned to
  // kKvLoanAlign, out of FreeRoom(from_token) in its order (a loan without pieces when none
  // fits). INVALID_ARGUMENT for record_bytes <= 0, max_records < 0 or from_token outside
  // [0, max_tokens]; FAILED_PRECONDITION while another loan is out or when from_token < length()
  // (those rows are live).
  absl::StatusOr<KvLoan> Lend(int64_t from_token, int64_t record_bytes, int64_t max_records);
  // How many pieces Lend would carve for the same arguments (0 for invalid ones).
  int64_t LendableRecords(int64_t from_token, int64_t record_bytes, int64_t max_records) const;
  // OK unless rows [first_row, first_row + rows) reach a row of the loan outstanding:
  // FAILED_PRECONDITION naming `what` (the forward that would write them) and the loan.
  absl::Status CheckWritable(int64_t first_row, int64_t rows, absl::string_view what) const;
  // The first row of the loan outstanding, if any.
  std::optional<int64_t> lent_from() const { return loan_->lent_from; }

 private:
  // Lend's carving: the pieces, each a KvCacheRange of record_bytes.
  std::vector<KvCacheRange> Carve(int64_t from_token, int64_t record_bytes, int64_t max_records) const;

  std::vector<LayerCache> layers_;
  std::shared_ptr<KvLoanState> loan_ = std::make_shared<KvLoanState>();
  kernels::DType dtype_ = kernels::DType::kF32;
  int64_t max_tokens_ = 0;
  int64_t length_ = 0;
};

}  // namespace nq::model
