// How a worker sizes its slot arena for a release (DESIGN.md sections 4 and 7): per MoE layer
// the decode step runs, the release's fixed 4-bit set, F floating slots the predictor fills,
// and one staging slot where a replacement lands before its victim is unmapped.
//
// The default F is what keeps streaming on: an arena sized only for the fixed set (the old
// default of 4 slots with a release's 4 fixed experts) leaves F = 0, and the predictor then
// has nothing to place. The MTP layer gets no slots: it never runs in decode, so loading its
// fixed set would spend reads and memory on experts nothing calls (until MTP decoding uses
// it).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "services/common/slot_geometry.h"
#include "services/model/model_config.h"
#include "services/release/release_expert_decoder.h"

namespace nq::worker {

// One slot per layer where a replacement lands before its victim leaves (lazy eviction).
inline constexpr uint32_t kStagingSlotsPerLayer = 1;

struct ArenaSizing {
  // Slots per layer; nullopt: fixed + floating + kStagingSlotsPerLayer, capped at the
  // experts per layer.
  std::optional<uint32_t> slots_per_layer;
  // Slots pinned to the fixed 4-bit set; nullopt: the release's largest fixed set.
  std::optional<uint32_t> fixed_slots_per_layer;
  // F when slots_per_layer is not given; nullopt: DefaultFloatingSlots(config).
  std::optional<uint32_t> floating_slots;
};

// Two tokens' worth of routed experts (2 x num_experts_per_tok): room for the experts the
// current tokens route to beyond the fixed set, with hysteresis to spare. glm5_nano (top-4 of
// 32): 8; GLM-5 (top-8 of 256): 16.
uint32_t DefaultFloatingSlots(const model::ModelConfig& config);

// The MoE layers the decode step runs, increasing: decoder layers only, not the MTP layers
// stored after them.
std::vector<uint32_t> DecodeMoeLayers(const model::ModelConfig& config);

// The arena geometry for serving `decoder`'s release: a row of slots per DecodeMoeLayers
// layer, each slot as large as the largest record of those layers. INVALID_ARGUMENT (from
// SlotGeometry::Validate, or naming the layer) when the sizing cannot hold the fixed set or
// exceeds the experts per layer, or the release lacks a decode layer's records.
absl::StatusOr<SlotGeometry> ReleaseArenaGeometry(const release::ReleaseExpertDecoder& decoder,
                                                  const model::ModelConfig& config, const ArenaSizing& sizing);

}  // namespace nq::worker
