// A release's routed experts as the model runs them (issue #12): each layer's resident planes
// (2-bit base codes, scales, codebooks, rotation) uploaded as packed kernels::NqMoeWeights, never
// dequantised to dense weights. 4-bit residuals stay in records, read in place from a slot.
// Both codecs have a packed kernel: nested_scalar_v1 (level tables) and trellis_v1 (per-column-
// block gains; the planes are already in the kernels' tile order).
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/model/model_weights.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

// The packed experts of `layer` on `backend`, without records (every expert at 2 bits until
// slots or records are given). FAILED_PRECONDITION for a codec without a packed kernel, or a
// layer whose experts disagree on shapes or rotations; DATA_LOSS for a malformed resident file.
absl::StatusOr<model::PackedExperts> LoadPackedExperts(const ReleaseExpertDecoder& decoder, uint32_t layer,
                                                       kernels::Backend& backend);

// Reads the records of `experts` of `layer` from the release into PackedExperts::records (slot i
// holds experts[i]) and points static_slots at them; the other experts stay at 2 bits.
absl::Status AttachRecords(const ReleaseExpertDecoder& decoder, uint32_t layer, std::span<const uint32_t> experts,
                           kernels::Backend& backend, model::PackedExperts& packed);

}  // namespace nq::release
