#include "services/worker/slot_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace nq::worker {

SlotTable::SlotTable(SlotGeometry geometry)
    : geometry_(std::move(geometry)),
      slots_(geometry_.moe_layer_ids.size() * geometry_.slots_per_layer),
      expert_slot_(geometry_.moe_layer_ids.size() * geometry_.experts_per_layer, kNoExpert) {}

absl::Status SlotTable::ApplyAtStepBoundary(const nq::v1::SlotTableUpdate& update,
                                            std::vector<nq::v1::SlotRef>* unmapped) {
  absl::MutexLock lock(&mu_);
  if (update.generation() <= applied_generation_) return absl::OkStatus();

  // Work on copies so a bad change leaves the table untouched (all or none).
  std::vector<Slot> slots = slots_;
  std::vector<int32_t> expert_slot = expert_slot_;
  std::vector<nq::v1::SlotRef> freed;
  for (const nq::v1::SlotChange& change : update.changes()) {
    absl::StatusOr<size_t> layer_index = geometry_.LayerIndex(change.layer());
    if (!layer_index.ok()) return layer_index.status();
    if (change.slot() >= geometry_.slots_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", change.slot(), " of layer ",
                                                     change.layer(), " out of range"));
    }
    Slot& slot = slots[*layer_index * geometry_.slots_per_layer + change.slot()];
    int32_t* experts_row = &expert_slot[*layer_index * geometry_.experts_per_layer];
    switch (change.kind()) {
      case nq::v1::SlotChange::KIND_READY: {
        if (change.expert() >= geometry_.experts_per_layer) {
          return absl::InvalidArgumentError(absl::StrCat("expert ", change.expert(), " of layer ",
                                                         change.layer(), " out of range"));
        }
        if (slot.expert != kNoExpert) {
          return absl::FailedPreconditionError(
              absl::StrCat("READY for layer ", change.layer(), " slot ", change.slot(),
                           " which the worker still maps (expert ", slot.expert, ")"));
        }
        if (experts_row[change.expert()] != kNoExpert) {
          return absl::FailedPreconditionError(
              absl::StrCat("expert ", change.expert(), " of layer ", change.layer(),
                           " is already READY in slot ", experts_row[change.expert()]));
        }
        slot.expert = static_cast<int32_t>(change.expert());
        slot.generation = update.generation();
        experts_row[change.expert()] = static_cast<int32_t>(change.slot());
        break;
      }
      case nq::v1::SlotChange::KIND_UNMAP: {
        if (slot.expert == kNoExpert) {
          return absl::FailedPreconditionError(absl::StrCat(
              "UNMAP of layer ", change.layer(), " slot ", change.slot(), " which is not mapped"));
        }
        experts_row[slot.expert] = kNoExpert;
        slot = Slot{};
        nq::v1::SlotRef& ref = freed.emplace_back();
        ref.set_layer(change.layer());
        ref.set_slot(change.slot());
        break;
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("slot change of unknown kind ", static_cast<int>(change.kind())));
    }
  }
  slots_ = std::move(slots);
  expert_slot_ = std::move(expert_slot);
  applied_generation_ = update.generation();
  if (unmapped != nullptr) unmapped->insert(unmapped->end(), freed.begin(), freed.end());
  return absl::OkStatus();
}

std::optional<uint32_t> SlotTable::SlotOf(uint32_t layer_id, uint32_t expert) const {
  absl::StatusOr<size_t> layer_index = geometry_.LayerIndex(layer_id);
  if (!layer_index.ok() || expert >= geometry_.experts_per_layer) return std::nullopt;
  absl::MutexLock lock(&mu_);
  const int32_t slot = expert_slot_[*layer_index * geometry_.experts_per_layer + expert];
  if (slot == kNoExpert) return std::nullopt;
  return static_cast<uint32_t>(slot);
}

void SlotTable::Clear() {
  absl::MutexLock lock(&mu_);
  applied_generation_ = 0;
  std::fill(slots_.begin(), slots_.end(), Slot{});
  std::fill(expert_slot_.begin(), expert_slot_.end(), kNoExpert);
}

uint64_t SlotTable::Digest() const {
  // FNV-1a 64 (offset basis and prime from the FNV specification).
  constexpr uint64_t kFnvOffset = 14695981039346656037ull;
  constexpr uint64_t kFnvPrime = 1099511628211ull;
  uint64_t hash = kFnvOffset;
  const auto mix = [&hash](uint32_t value) {
    for (int b = 0; b < 4; ++b) {
      hash ^= (value >> (8 * b)) & 0xff;
      hash *= kFnvPrime;
    }
  };
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].expert == kNoExpert) continue;
    mix(geometry_.moe_layer_ids[i / geometry_.slots_per_layer]);
    mix(static_cast<uint32_t>(i % geometry_.slots_per_layer));
    mix(static_cast<uint32_t>(slots_[i].expert));
  }
  return hash;
}

std::vector<nq::v1::SlotEntry> SlotTable::ReadySlots() const {
  absl::MutexLock lock(&mu_);
  std::vector<nq::v1::SlotEntry> ready;
  for (size_t layer_index = 0; layer_index < geometry_.moe_layer_ids.size(); ++layer_index) {
    for (uint32_t s = 0; s < geometry_.slots_per_layer; ++s) {
      const Slot& slot = slots_[layer_index * geometry_.slots_per_layer + s];
      if (slot.expert == kNoExpert) continue;
      nq::v1::SlotEntry& entry = ready.emplace_back();
      entry.set_layer(geometry_.moe_layer_ids[layer_index]);
      entry.set_slot(s);
      entry.set_expert(static_cast<uint32_t>(slot.expert));
      entry.set_generation(slot.generation);
    }
  }
  return ready;
}

uint64_t SlotTable::applied_generation() const {
  absl::MutexLock lock(&mu_);
  return applied_generation_;
}

}  // namespace nq::worker
