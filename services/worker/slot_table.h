// The worker's view of its slot arena: which expert's residual each slot holds. Changed only
// between decode steps (DESIGN.md section 4), so the lock a step takes to read it is never
// contended while the step runs.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.pb.h"
#include "services/common/slot_geometry.h"

namespace nq::worker {

class SlotTable {
 public:
  explicit SlotTable(SlotGeometry geometry);

  // Applies one streamer update at a step boundary, all changes or none.
  //  - generation <= applied_generation(): a stale or duplicate update, ignored (OK).
  //  - READY on a slot the worker still maps, an expert already READY elsewhere in the layer,
  //    an out-of-range layer/slot/expert, or UNMAP of a slot that is not mapped: the update is
  //    rejected whole with INVALID_ARGUMENT / FAILED_PRECONDITION (the streamer broke the
  //    protocol; the table keeps its previous state).
  // Slots unmapped by this update are appended to `unmapped` for the UnmapAck.
  absl::Status ApplyAtStepBoundary(const nq::v1::SlotTableUpdate& update,
                                   std::vector<nq::v1::SlotRef>* unmapped);

  // The slot holding `expert`'s residual in model layer `layer_id`, or nullopt when the expert
  // runs at 2 bits.
  std::optional<uint32_t> SlotOf(uint32_t layer_id, uint32_t expert) const;

  // Forgets every slot and the applied generation (a rank of a newly formed tensor-parallel
  // group: the table must start where every other rank's does). Between steps only.
  void Clear();
  // A digest of the READY slots (layer, slot, expert), the same on every host and build (FNV-1a,
  // not absl::Hash, which is seeded per process): ranks of a group compare tables by it.
  uint64_t Digest() const;

  // The READY slots, for a session hello after a streamer restart.
  std::vector<nq::v1::SlotEntry> ReadySlots() const;
  uint64_t applied_generation() const;
  const SlotGeometry& geometry() const { return geometry_; }

 private:
  static constexpr int32_t kNoExpert = -1;
  struct Slot {
    int32_t expert = kNoExpert;
    uint64_t generation = 0;
  };

  const SlotGeometry geometry_;
  mutable absl::Mutex mu_;
  uint64_t applied_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // slots_[layer_index * slots_per_layer + slot]
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  // expert_slot_[layer_index * experts_per_layer + expert]: slot index or -1.
  std::vector<int32_t> expert_slot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace nq::worker
