// The streamer's view of one worker's slot arena (DESIGN.md section 4): the state of every
// slot, so that a slot is written only while the worker does not map it.
//
//   FREE --Reserve--> LOADING --MarkReady--> READY --MarkUnmapping--> UNMAPPING --Acknowledge--> FREE
//                        \--Release (read failed or cancelled)--> FREE
//
// Slots [0, fixed_slots_per_layer) of a layer hold its fixed 4-bit set; the rest hold the
// floating set plus one staging slot, so a replacement can land before its victim is unmapped
// (lazy eviction). Only LOADING slots are writable. Not thread-safe: the loader thread owns it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "nq/v1/streamer.pb.h"
#include "services/common/slot_geometry.h"

namespace nq::streamer {

enum class SlotState { kFree, kLoading, kReady, kUnmapping };

class SlotAllocator {
 public:
  explicit SlotAllocator(SlotGeometry geometry);

  const SlotGeometry& geometry() const { return geometry_; }
  // F: floating 4-bit experts per layer (the non-fixed slots minus one staging slot when
  // there are at least two).
  uint32_t floating_slots() const { return floating_slots_; }

  // Resync after a (streamer) restart: takes the worker's READY slots as READY. Every other
  // slot becomes FREE. INVALID_ARGUMENT for an entry outside the geometry, two entries for
  // one slot, or one expert in two slots of a layer (the table is left empty).
  absl::Status Adopt(std::span<const nq::v1::SlotEntry> ready);

  // FREE -> LOADING for `expert`, in the fixed region or the floating region. nullopt when the
  // region has no FREE slot. The caller checks that the expert is not already present.
  std::optional<uint32_t> Reserve(size_t layer_index, uint32_t expert, bool fixed);
  // LOADING -> READY; LOADING -> FREE; READY -> UNMAPPING; UNMAPPING -> FREE. Each returns
  // FAILED_PRECONDITION (state unchanged) when the slot is not in the required state.
  absl::Status MarkReady(size_t layer_index, uint32_t slot);
  absl::Status Release(size_t layer_index, uint32_t slot);
  absl::Status MarkUnmapping(size_t layer_index, uint32_t slot);
  absl::Status Acknowledge(size_t layer_index, uint32_t slot);

  SlotState state(size_t layer_index, uint32_t slot) const { return At(layer_index, slot).state; }
  // The expert a non-FREE slot holds or is loading.
  int32_t expert(size_t layer_index, uint32_t slot) const { return At(layer_index, slot).expert; }
  // Only a LOADING slot may be written (the worker does not map it).
  bool Writable(size_t layer_index, uint32_t slot) const { return state(layer_index, slot) == SlotState::kLoading; }
  // The slot in which `expert` is LOADING or READY (not UNMAPPING), if any.
  std::optional<uint32_t> SlotOf(size_t layer_index, uint32_t expert) const;
  // Experts LOADING or READY in the layer's floating region.
  std::vector<uint32_t> FloatingExperts(size_t layer_index) const;
  size_t CountInState(SlotState state) const;

 private:
  struct Slot {
    SlotState state = SlotState::kFree;
    int32_t expert = -1;
  };
  Slot& At(size_t layer_index, uint32_t slot) { return slots_[layer_index * geometry_.slots_per_layer + slot]; }
  const Slot& At(size_t layer_index, uint32_t slot) const {
    return slots_[layer_index * geometry_.slots_per_layer + slot];
  }
  absl::Status Move(size_t layer_index, uint32_t slot, SlotState from, SlotState to, const char* what);

  const SlotGeometry geometry_;
  const uint32_t floating_slots_;
  std::vector<Slot> slots_;
};

}  // namespace nq::streamer
