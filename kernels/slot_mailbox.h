// One MoE layer's row of the slot mailbox (DESIGN.md section 4, docs/gpu_mailbox.md): how slot
// table changes reach a decode step without the host. For each routed expert e of the layer:
//
//   staged[e]     the slot the streamer last posted for e (-1: unmapped)   streamer writes
//   seq[e]        bumped by the streamer after staged[e], with release      streamer writes
//   published[e]  (seq, slot) the worker last applied, for the host eyes   worker writes
//
// All three live in host memory shared by the worker and the streamer (services/common/
// slot_mailbox.h); on a GPU the worker maps it into the device's address space, and these
// pointers are the device's aliases. Backend::ApplySlotMailbox, the first op of the layer's MoE
// block, applies the row: where seq[e] moved past the worker's private copy it takes staged[e]
// and publishes (seq, slot); then every entry of the layer's slot table is rewritten from the
// private copy (so a layer-major prefill that borrowed the table leaves nothing behind).
#pragma once

#include <atomic>
#include <cstdint>

#include "kernels/dtype.h"  // NQ_HOST_DEVICE

namespace nq::kernels {

struct SlotMailboxRow {
  const std::int32_t* staged = nullptr;
  const std::uint32_t* seq = nullptr;
  std::uint64_t* published = nullptr;
  std::int32_t experts = 0;
};

// A published entry: the applied sequence number in the high word, the slot (-1: none) in the low.
NQ_HOST_DEVICE constexpr std::uint64_t PackMailboxEntry(std::uint32_t seq, std::int32_t slot) {
  return (static_cast<std::uint64_t>(seq) << 32) | static_cast<std::uint32_t>(slot);
}
NQ_HOST_DEVICE constexpr std::uint32_t MailboxEntrySeq(std::uint64_t entry) { return static_cast<std::uint32_t>(entry >> 32); }
NQ_HOST_DEVICE constexpr std::int32_t MailboxEntrySlot(std::uint64_t entry) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(entry));
}
// What every entry of a new mailbox holds: nothing posted, nothing mapped.
inline constexpr std::uint64_t kMailboxEmptyEntry = PackMailboxEntry(0, -1);

// Whether `seq` is at or past `target` (sequence numbers wrap: compared by their difference).
NQ_HOST_DEVICE constexpr bool MailboxSeqReached(std::uint32_t seq, std::uint32_t target) {
  return static_cast<std::int32_t>(seq - target) >= 0;
}

// The apply on the host, over host memory: what the CPU backend runs, and the CUDA kernel's
// oracle. `applied` holds the worker's private (seq, slot) per expert, packed like published.
// staged is loaded with acquire too: when the streamer posts again between the two loads, the
// newer row's slot bytes must be visible with it.
inline void ApplySlotMailboxRowHost(const SlotMailboxRow& row, std::uint64_t* applied, std::int32_t* slot_of_expert) {
  for (std::int32_t e = 0; e < row.experts; ++e) {
    // atomic_ref needs a mutable object; these loads never write.
    const std::uint32_t seq =
        std::atomic_ref<std::uint32_t>(const_cast<std::uint32_t&>(row.seq[e])).load(std::memory_order_acquire);
    if (seq != MailboxEntrySeq(applied[e])) {
      const std::int32_t slot =
          std::atomic_ref<std::int32_t>(const_cast<std::int32_t&>(row.staged[e])).load(std::memory_order_acquire);
      applied[e] = PackMailboxEntry(seq, slot);
      std::atomic_ref<std::uint64_t>(row.published[e]).store(applied[e], std::memory_order_release);
    }
    slot_of_expert[e] = MailboxEntrySlot(applied[e]);
  }
}

}  // namespace nq::kernels
