// The slot mailbox of a worker (DESIGN.md section 4, docs/gpu_mailbox.md, kernels/slot_mailbox.h):
// a POSIX shared-memory object the worker creates and the node's streamer maps, through which
// slot-table changes reach the worker's decode steps without a message on the step path.
//
//   streamer:  record bytes into the slot (complete on the device)  ->  Post(layer, expert, slot)
//   worker:    every MoE layer of every forward applies its row (Backend::ApplySlotMailbox) and
//              publishes (seq, slot); between steps the worker reads Published() for its books
//   streamer:  reuses an unmapped slot once Published(layer, expert) reached the unmap's seq
//
// Layout: a 64-byte header (magic, version, layers, experts), then staged (int32), seq (uint32)
// and published (uint64, kernels/slot_mailbox.h's packing), each [layers * experts] in the
// geometry's layer order, published 8-byte aligned. One writer posts (the worker's streamer
// session): Post is not safe against a second poster of the same expert.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/slot_mailbox.h"
#include "services/common/shared_memory.h"

namespace nq {

class SlotMailbox {
 public:
  // Bytes of the shared object for this many MoE layers and experts per layer.
  static uint64_t BytesFor(uint32_t layers, uint32_t experts);
  // The worker's: a new object `name` (shm naming rules; must not exist), every expert
  // unmapped. INVALID_ARGUMENT for no layers or experts.
  static absl::StatusOr<SlotMailbox> Create(const std::string& name, uint32_t layers, uint32_t experts);
  // The streamer's: maps `name` and checks its header against the geometry it expects.
  // NOT_FOUND when it does not exist; FAILED_PRECONDITION for another size, magic, version or
  // shape (naming both).
  static absl::StatusOr<SlotMailbox> Open(const std::string& name, uint32_t layers, uint32_t experts);

  SlotMailbox() = default;
  SlotMailbox(SlotMailbox&&) noexcept = default;
  SlotMailbox& operator=(SlotMailbox&&) noexcept = default;

  uint32_t layers() const { return layers_; }
  uint32_t experts() const { return experts_; }
  const std::string& name() const { return memory_.name(); }
  uint64_t bytes() const { return memory_.size(); }
  // The whole object, for a device mapping (cudaHostRegister) of it.
  std::byte* data() const { return reinterpret_cast<std::byte*>(memory_.data()); }

  // Layer index `layer` (geometry order) as the apply op reads it, in this process's addresses;
  // `alias` rebases it onto another mapping of the same object (a device's), when not null.
  kernels::SlotMailboxRow Row(size_t layer, std::byte* alias = nullptr) const;
  // Every layer's entries as one row of layers() x experts() (layer-major), which one apply op
  // takes at once.
  kernels::SlotMailboxRow AllRows(std::byte* alias = nullptr) const;

  // --- The streamer. Posts `slot` (-1: unmap) for (layer, expert): staged, then seq + 1, each
  // with release. The slot's bytes must be complete where the worker reads them before the call.
  // Returns the posted sequence number; OUT_OF_RANGE for a layer or expert outside the mailbox.
  absl::StatusOr<uint32_t> Post(size_t layer, uint32_t expert, int32_t slot);
  // The sequence number last posted for (layer, expert).
  uint32_t PostedSeq(size_t layer, uint32_t expert) const;

  // --- Either side. The (seq, slot) the worker last applied, packed (kernels/slot_mailbox.h).
  uint64_t Published(size_t layer, uint32_t expert) const;

  // --- The worker, while no forward runs (idle, or before a session hello): publishes every
  // posted row the way the apply op would, without the device. The device's private copies catch
  // up at the next forward's apply, before any kernel reads the table. Returns the rows taken.
  size_t ApplyOnHost();

 private:
  SlotMailbox(SharedMemory memory, uint32_t layers, uint32_t experts);
  size_t Index(size_t layer, uint32_t expert) const { return layer * experts_ + expert; }
  int32_t* staged() const;
  uint32_t* seq() const;
  uint64_t* published() const;

  SharedMemory memory_;
  uint32_t layers_ = 0;
  uint32_t experts_ = 0;
};

}  // namespace nq
