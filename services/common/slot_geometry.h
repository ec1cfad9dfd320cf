// Geometry of a worker's slot arena (DESIGN.md section 4): for each MoE layer, a row of
// slots that each hold one expert's residual record. Shared by the worker (which allocates
// the arena) and the streamer (which writes into it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq {

// Records are read with O_DIRECT, so every record, and every slot, is a multiple of the
// largest logical block size we expect on NVMe (DESIGN.md section 5).
inline constexpr uint64_t kRecordAlign = 4096;

struct SlotGeometry {
  std::vector<uint32_t> moe_layer_ids;  // strictly increasing model layer ids
  uint32_t slots_per_layer = 0;
  uint64_t rec_bytes = 0;          // multiple of kRecordAlign
  uint64_t slot_stride_bytes = 0;  // >= rec_bytes, multiple of kRecordAlign
  uint32_t experts_per_layer = 0;
  uint32_t fixed_slots_per_layer = 0;  // <= slots_per_layer

  // A geometry with the stride set to rec_bytes (the densest packing).
  static SlotGeometry Packed(std::vector<uint32_t> moe_layer_ids, uint32_t slots_per_layer,
                             uint64_t rec_bytes, uint32_t experts_per_layer,
                             uint32_t fixed_slots_per_layer);
  static absl::StatusOr<SlotGeometry> FromProto(const nq::v1::SlotGeometry& proto);
  nq::v1::SlotGeometry ToProto() const;

  // INVALID_ARGUMENT naming the first rule broken.
  absl::Status Validate() const;
  // F, the floating 4-bit experts per layer: the slots outside the fixed set, less one
  // staging slot (a replacement lands there before its victim is unmapped) when there are
  // at least two. 0 means only the fixed set can run at 4 bits: the predictor has nothing
  // to place.
  uint32_t FloatingSlots() const;
  uint64_t ArenaBytes() const;
  // Byte offset of slot `slot` of the `layer_index`-th MoE layer (an index into
  // moe_layer_ids, not a model layer id).
  uint64_t SlotOffset(size_t layer_index, uint32_t slot) const;
  // Index of a model layer id in moe_layer_ids, or NOT_FOUND.
  absl::StatusOr<size_t> LayerIndex(uint32_t layer_id) const;
};

// OK when [offset, offset + size) lies inside an arena of `bytes`; else OUT_OF_RANGE naming
// `access` ("read", "write"). Every access to an arena by offset (the streamer's writes, the
// worker's --verify_slots reads) goes through it.
absl::Status CheckArenaRange(const char* access, uint64_t offset, uint64_t size, uint64_t bytes);

}  // namespace nq
