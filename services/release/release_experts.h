// Serving routed experts from a NestQuant release (DESIGN.md sections 5 and 6; issue #12): each
// MoE layer holds its experts only as the release's packed codes (packed_experts.h), dequantised
// inside the kernels. Without a streamer, a policy picks all-2-bit, all-4-bit, or the manifest's
// fixed set (whose records the layer then keeps); a worker's slots make the choice dynamic.
#pragma once

#include <span>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "services/model/model_weights.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

enum class ExpertBits { k2Bit, k4Bit, kFixedSet };

// "2", "4" or "fixed".
absl::StatusOr<ExpertBits> ParseExpertBits(const std::string& text);

// Opens `release_dir` (refused without COMPLETE), checks that it was made from this model
// (config hash, TP size, MoE layers, experts; FAILED_PRECONDITION naming the mismatch), and
// gives every MoE layer of `weights` (rank `tp.rank`) its packed experts, with the records of the
// experts `bits` runs at 4 bits. Dense routed experts in `weights`, if any, are dropped.
absl::Status ApplyReleaseExperts(const std::string& release_dir, const std::string& model_dir,
                                 const model::ModelConfig& config, model::TensorParallel tp, ExpertBits bits,
                                 kernels::Backend& backend, model::ModelWeights& weights);
// The same with an open decoder (which the worker keeps for its slot geometry).
absl::Status ApplyReleaseExperts(const ReleaseExpertDecoder& decoder, const model::ModelConfig& config,
                                 ExpertBits bits, kernels::Backend& backend, model::ModelWeights& weights);

// Model::Load with the routed experts taken from `release_dir` at `bits`.
absl::StatusOr<std::unique_ptr<model::Model>> LoadModelWithRelease(const std::string& model_dir,
                                                                   const std::string& release_dir, ExpertBits bits,
                                                                   kernels::Backend& backend,
                                                                   kernels::Communicator* comm,
                                                                   model::ModelOptions options);

}  // namespace nq::release
