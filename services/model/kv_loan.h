// Room the free KV cache lends a layer-major prefill for extra expert slots (issue #23's slot
// borrowing).
//
// Why the room is free: during a layer-major prefill of the span [L0, L0 + T) the model writes
// cache rows [L0, L0 + T) only, and attention and the DSA indexer read positions below a
// forward's end only, so rows [L0 + T, max_tokens) of every cache tensor (each layer's latent,
// rope key and indexer keys, the MTP layers' included) hold nothing anyone reads until a later
// forward writes them. KvCache::Lend carves record-sized pieces out of that room; a prefill's
// expert records live there while it runs.
//
// A lent piece has one owner at any time, as a streamer slot does (DESIGN.md section 4):
//   LENT      from KvCache::Lend to the loan's return. The loan's holder alone writes the piece
//             (PrefillExperts: an upload after a Synchronize, so after every kernel that read
//             the layer before) and its kernels alone read it. The cache refuses any forward
//             that would write a lent row (KvCache::CheckWritable: FAILED_PRECONDITION), so a
//             cache that grew into the loan is an error, never a corrupted record or KV row.
//   RETURNED  KvLoan::Return (or its destructor), which the holder calls once no kernel can
//             still read or write the piece (PrefillExperts::End synchronizes first). The rows
//             are the cache's again; the next forward overwrites them before any query reads
//             them, as it does rows past a truncation.
// One loan is out at a time per cache. Tensor-parallel ranks each hold their own cache, so each
// lends its own room; the caches have one geometry, so every rank carves the same count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kernels/tensor.h"

namespace nq::model {

// Each lent piece starts at an address that is a multiple of this: a release's record segments
// start on 256-byte boundaries inside a record (DESIGN.md section 5), so a piece aligned so keeps
// every segment as aligned as in a slot arena, which the kernels' vector loads assume.
inline constexpr std::size_t kKvLoanAlign = 256;

// The tensors of one cache layer (LayerCache).
enum class KvCachePart { kLatent, kRopeKey, kIndexKeys };
const char* KvCachePartName(KvCachePart part);

// Bytes [offset, offset + bytes) of one cache tensor.
struct KvCacheRange {
  std::size_t cache_layer = 0;  // decoder layers, then MTP layers
  KvCachePart part = KvCachePart::kLatent;
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

// One piece of a loan: `range` of the cache tensor `tensor`.
struct KvLentRecord {
  kernels::Tensor* tensor = nullptr;
  KvCacheRange range;
  const std::byte* address() const { return static_cast<const std::byte*>(tensor->data()) + range.offset; }
};

// What a cache knows of its loan (shared with the loan, so a moved cache keeps it).
struct KvLoanState {
  std::optional<int64_t> lent_from;  // the first row of the loan outstanding
  int64_t records = 0;
};

// A loan of the free KV cache's room (above): move-only, returned by Return or on destruction.
// Must not outlive the cache's tensors.
class KvLoan {
 public:
  KvLoan() = default;  // lends nothing
  KvLoan(KvLoan&& other) noexcept;
  KvLoan& operator=(KvLoan&& other) noexcept;
  KvLoan(const KvLoan&) = delete;
  KvLoan& operator=(const KvLoan&) = delete;
  ~KvLoan() { Return(); }

  // The pieces, in the cache's order (KvCache::FreeRoom), each `record_bytes` long.
  const std::vector<KvLentRecord>& records() const { return records_; }
  // Every piece lies in rows >= from_token() of its tensor.
  int64_t from_token() const { return from_token_; }
  bool outstanding() const { return state_ != nullptr; }
  // Hands the pieces back (no-op when none are out). The caller guarantees that nothing reads
  // or writes them any more, queued device work included.
  void Return();

 private:
  friend class KvCache;
  KvLoan(std::shared_ptr<KvLoanState> state, int64_t from_token, std::vector<KvLentRecord> records)
      : state_(std::move(state)), from_token_(from_token), records_(std::move(records)) {}

  std::shared_ptr<KvLoanState> state_;
  int64_t from_token_ = 0;
  std::vector<KvLentRecord> records_;
};

}  // namespace nq::model
