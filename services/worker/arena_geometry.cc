#include "services/worker/arena_geometry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {

uint32_t DefaultFloatingSlots(const model::ModelConfig& config) {
  return static_cast<uint32_t>(2 * std::max<int64_t>(config.num_experts_per_tok, 1));
}

std::vector<uint32_t> DecodeMoeLayers(const model::ModelConfig& config) {
  std::vector<uint32_t> layers;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsMoeLayer(l)) layers.push_back(static_cast<uint32_t>(l));
  }
  return layers;
}

absl::StatusOr<SlotGeometry> ReleaseArenaGeometry(const release::ReleaseExpertDecoder& decoder,
                                                  const model::ModelConfig& config, const ArenaSizing& sizing) {
  const uint32_t experts = decoder.release().manifest().experts_per_layer;
  std::vector<uint32_t> layers = DecodeMoeLayers(config);
  uint64_t rec_bytes = 0;
  size_t largest_fixed = 0;
  for (uint32_t layer : layers) {
    absl::StatusOr<uint64_t> bytes = decoder.RecordBytes(layer);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the release has no records for MoE layer ", layer, ": ", bytes.status().message()));
    }
    rec_bytes = std::max(rec_bytes, *bytes);
    largest_fixed = std::max(largest_fixed, decoder.FixedSet(layer).size());
  }
  const uint32_t fixed = sizing.fixed_slots_per_layer.value_or(static_cast<uint32_t>(largest_fixed));
  uint32_t slots = 0;
  if (sizing.slots_per_layer.has_value()) {
    slots = *sizing.slots_per_layer;
  } else {
    const uint32_t floating = sizing.floating_slots.value_or(DefaultFloatingSlots(config));
    slots = std::min(fixed + floating + kStagingSlotsPerLayer, experts);
  }
  SlotGeometry geometry = SlotGeometry::Packed(std::move(layers), slots, rec_bytes, experts, fixed);
  RETURN_IF_ERROR(geometry.Validate());
  return geometry;
}

}  // namespace nq::worker
