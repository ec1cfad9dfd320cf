#include "services/common/slot_geometry.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace nq {

SlotGeometry SlotGeometry::Packed(std::vector<uint32_t> moe_layer_ids, uint32_t slots_per_layer,
                                  uint64_t rec_bytes, uint32_t experts_per_layer,
                                  uint32_t fixed_slots_per_layer) {
  SlotGeometry geometry;
  geometry.moe_layer_ids = std::move(moe_layer_ids);
  geometry.slots_per_layer = slots_per_layer;
  geometry.rec_bytes = rec_bytes;
  geometry.slot_stride_bytes = rec_bytes;
  geometry.experts_per_layer = experts_per_layer;
  geometry.fixed_slots_per_layer = fixed_slots_per_layer;
  return geometry;
}

absl::StatusOr<SlotGeometry> SlotGeometry::FromProto(const nq::v1::SlotGeometry& proto) {
  SlotGeometry geometry;
  geometry.moe_layer_ids.assign(proto.moe_layer_ids().begin(), proto.moe_layer_ids().end());
  geometry.slots_per_layer = proto.slots_per_layer();
  geometry.rec_bytes = proto.rec_bytes();
  geometry.slot_stride_bytes = proto.slot_stride_bytes();
  geometry.experts_per_layer = proto.experts_per_layer();
  geometry.fixed_slots_per_layer = proto.fixed_slots_per_layer();
  if (absl::Status s = geometry.Validate(); !s.ok()) return s;
  return geometry;
}

nq::v1::SlotGeometry SlotGeometry::ToProto() const {
  nq::v1::SlotGeometry proto;
  proto.mutable_moe_layer_ids()->Add(moe_layer_ids.begin(), moe_layer_ids.end());
  proto.set_slots_per_layer(slots_per_layer);
  proto.set_rec_bytes(rec_bytes);
  proto.set_slot_stride_bytes(slot_stride_bytes);
  proto.set_experts_per_layer(experts_per_layer);
  proto.set_fixed_slots_per_layer(fixed_slots_per_layer);
  return proto;
}

uint32_t SlotGeometry::FloatingSlots() const {
  const uint32_t non_fixed = slots_per_layer - std::min(fixed_slots_per_layer, slots_per_layer);
  return non_fixed >= 2 ? non_fixed - 1 : non_fixed;
}

absl::Status SlotGeometry::Validate() const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("slot geometry: ", parts...));
  };
  if (moe_layer_ids.empty()) return invalid("no MoE layers");
  if (!std::is_sorted(moe_layer_ids.begin(), moe_layer_ids.end()) ||
      std::adjacent_find(moe_layer_ids.begin(), moe_layer_ids.end()) != moe_layer_ids.end()) {
    return invalid("MoE layer ids must be strictly increasing");
  }
  if (slots_per_layer == 0) return invalid("slots_per_layer is 0");
  if (experts_per_layer == 0) return invalid("experts_per_layer is 0");
  if (slots_per_layer > experts_per_layer) {
    return invalid("slots_per_layer ", slots_per_layer, " exceeds experts_per_layer ",
                   experts_per_layer);
  }
  if (fixed_slots_per_layer > slots_per_layer) {
    return invalid("fixed_slots_per_layer ", fixed_slots_per_layer, " exceeds slots_per_layer ",
                   slots_per_layer);
  }
  if (rec_bytes == 0 || rec_bytes % kRecordAlign != 0) {
    return invalid("rec_bytes ", rec_bytes, " is not a positive multiple of ", kRecordAlign);
  }
  if (slot_stride_bytes < rec_bytes || slot_stride_bytes % kRecordAlign != 0) {
    return invalid("slot_stride_bytes ", slot_stride_bytes, " must be >= rec_bytes and a multiple of ",
                   kRecordAlign);
  }
  const uint64_t slots = static_cast<uint64_t>(moe_layer_ids.size()) * slots_per_layer;
  if (slot_stride_bytes > std::numeric_limits<uint64_t>::max() / slots) {
    return invalid("arena size overflows");
  }
  return absl::OkStatus();
}

uint64_t SlotGeometry::ArenaBytes() const {
  return static_cast<uint64_t>(moe_layer_ids.size()) * slots_per_layer * slot_stride_bytes;
}

uint64_t SlotGeometry::SlotOffset(size_t layer_index, uint32_t slot) const {
  return (static_cast<uint64_t>(layer_index) * slots_per_layer + slot) * slot_stride_bytes;
}

absl::StatusOr<size_t> SlotGeometry::LayerIndex(uint32_t layer_id) const {
  auto it = std::lower_bound(moe_layer_ids.begin(), moe_layer_ids.end(), layer_id);
  if (it == moe_layer_ids.end() || *it != layer_id) {
    return absl::NotFoundError(absl::StrCat("layer ", layer_id, " has no slots (not a MoE layer)"));
  }
  return static_cast<size_t>(it - moe_layer_ids.begin());
}

absl::Status CheckArenaRange(const char* access, uint64_t offset, uint64_t size, uint64_t bytes) {
  if (offset > bytes || size > bytes - offset) {
    return absl::OutOfRangeError(absl::StrCat(access, " of ", size, " bytes at ", offset, " leaves the arena of ", bytes,
                                              " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace nq
