#include "services/streamer/slot_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace nq::streamer {
namespace {

const char* StateName(SlotState state) {
  switch (state) {
    case SlotState::kFree: return "FREE";
    case SlotState::kLoading: return "LOADING";
    case SlotState::kReady: return "READY";
    case SlotState::kUnmapping: return "UNMAPPING";
  }
  return "?";
}

}  // namespace

SlotAllocator::SlotAllocator(SlotGeometry geometry)
    : geometry_(std::move(geometry)),
      floating_slots_(geometry_.FloatingSlots()),
      slots_(geometry_.moe_layer_ids.size() * geometry_.slots_per_layer) {}

absl::Status SlotAllocator::Adopt(std::span<const nq::v1::SlotEntry> ready) {
  std::vector<Slot> slots(slots_.size());
  for (const nq::v1::SlotEntry& entry : ready) {
    absl::StatusOr<size_t> layer_index = geometry_.LayerIndex(entry.layer());
    if (!layer_index.ok()) return layer_index.status();
    if (entry.slot() >= geometry_.slots_per_layer || entry.expert() >= geometry_.experts_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat("READY slot ", entry.slot(), " (expert ", entry.expert(),
                                                     ") of layer ", entry.layer(), " is outside the geometry"));
    }
    Slot* row = &slots[*layer_index * geometry_.slots_per_layer];
    for (uint32_t s = 0; s < geometry_.slots_per_layer; ++s) {
      if (row[s].state != SlotState::kFree && (s == entry.slot() || row[s].expert == static_cast<int32_t>(entry.expert()))) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", entry.layer(), ": slot ", entry.slot(), " or expert ",
                                                       entry.expert(), " is listed twice"));
      }
    }
    row[entry.slot()] = Slot{SlotState::kReady, static_cast<int32_t>(entry.expert())};
  }
  slots_ = std::move(slots);
  return absl::OkStatus();
}

std::optional<uint32_t> SlotAllocator::Reserve(size_t layer_index, uint32_t expert, bool fixed) {
  const uint32_t fixed_end = std::min(geometry_.fixed_slots_per_layer, geometry_.slots_per_layer);
  const uint32_t begin = fixed ? 0 : fixed_end;
  const uint32_t end = fixed ? fixed_end : geometry_.slots_per_layer;
  for (uint32_t s = begin; s < end; ++s) {
    Slot& slot = At(layer_index, s);
    if (slot.state != SlotState::kFree) continue;
    slot = Slot{SlotState::kLoading, static_cast<int32_t>(expert)};
    return s;
  }
  return std::nullopt;
}

absl::Status SlotAllocator::Move(size_t layer_index, uint32_t slot, SlotState from, SlotState to, const char* what) {
  if (layer_index >= geometry_.moe_layer_ids.size() || slot >= geometry_.slots_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": slot ", slot, " of layer index ", layer_index,
                                                   " is outside the geometry"));
  }
  Slot& s = At(layer_index, slot);
  if (s.state != from) {
    return absl::FailedPreconditionError(absl::StrCat(what, " of layer ", geometry_.moe_layer_ids[layer_index],
                                                      " slot ", slot, ": it is ", StateName(s.state), ", not ",
                                                      StateName(from)));
  }
  s.state = to;
  if (to == SlotState::kFree) s.expert = -1;
  return absl::OkStatus();
}

absl::Status SlotAllocator::MarkReady(size_t layer_index, uint32_t slot) {
  return Move(layer_index, slot, SlotState::kLoading, SlotState::kReady, "READY");
}
absl::Status SlotAllocator::Release(size_t layer_index, uint32_t slot) {
  return Move(layer_index, slot, SlotState::kLoading, SlotState::kFree, "release");
}
absl::Status SlotAllocator::MarkUnmapping(size_t layer_index, uint32_t slot) {
  return Move(layer_index, slot, SlotState::kReady, SlotState::kUnmapping, "UNMAP");
}
absl::Status SlotAllocator::Acknowledge(size_t layer_index, uint32_t slot) {
  return Move(layer_index, slot, SlotState::kUnmapping, SlotState::kFree, "unmap acknowledgement");
}

std::optional<uint32_t> SlotAllocator::SlotOf(size_t layer_index, uint32_t expert) const {
  for (uint32_t s = 0; s < geometry_.slots_per_layer; ++s) {
    const Slot& slot = At(layer_index, s);
    if ((slot.state == SlotState::kLoading || slot.state == SlotState::kReady) &&
        slot.expert == static_cast<int32_t>(expert)) {
      return s;
    }
  }
  return std::nullopt;
}

std::vector<uint32_t> SlotAllocator::FloatingExperts(size_t layer_index) const {
  std::vector<uint32_t> experts;
  for (uint32_t s = std::min(geometry_.fixed_slots_per_layer, geometry_.slots_per_layer); s < geometry_.slots_per_layer;
       ++s) {
    const Slot& slot = At(layer_index, s);
    if (slot.state == SlotState::kLoading || slot.state == SlotState::kReady) {
      experts.push_back(static_cast<uint32_t>(slot.expert));
    }
  }
  return experts;
}

size_t SlotAllocator::CountInState(SlotState state) const {
  return static_cast<size_t>(std::count_if(slots_.begin(), slots_.end(), [&](const Slot& s) { return s.state == state; }));
}

}  // namespace nq::streamer
