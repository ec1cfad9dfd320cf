// Serving routed experts from a NestQuant release (DESIGN.md sections 5 and 6; issue #12): each
// MoE layer holds its experts only as the release's packed codes (packed_experts.h), dequantised
// inside the kernels. Without a streamer, a policy picks all-2-bit, all-4-bit, or the manifest's
// fixed set (whose records the layer then keeps); a worker's slots make the choice dynamic.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "services/model/model_weights.h"
#include "services/nvfp4/served_experts.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

enum class ExpertBits { k2Bit, k4Bit, kFixedSet };

// "2", "4" or "fixed".
absl::StatusOr<ExpertBits> ParseExpertBits(const std::string& text);

// Gives every MoE layer of `weights` (the rank `decoder` was opened for) its packed experts from
// the release `decoder` opened (ReleaseExpertDecoder::Open checked it against the model), with
// the records of the experts `bits` runs at 4 bits. Dense routed experts in `weights`, if any,
// are dropped.
absl::Status ApplyReleaseExperts(const ReleaseExpertDecoder& decoder, const model::ModelConfig& config,
                                 ExpertBits bits, kernels::Backend& backend, model::ModelWeights& weights);

// A model as nq-worker serves it, and the open decoder of its release (null without one).
struct ServedModel {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<ReleaseExpertDecoder> decoder;
};

// The one load nq-worker and the `nq` commands that stand in for it (bench-decode, kld) share.
// Without `release_dir`: Model::Load of `model_dir`, except that an NVFP4 checkpoint
// (nvfp4::IsNvfp4Checkpoint) keeps its routed experts packed (nvfp4::LoadNvfp4Experts, gate/up
// fused as `nvfp4` says; errors "NVFP4 checkpoint DIR: ..."). With one: the release is opened and
// checked against the model first (so a wrong release fails before the weights are read), then
// the checkpoint's weights load without its routed experts (a checkpoint stripped of them
// serves) and every MoE layer gets the release's packed experts at `bits`. A release that
// fails to open or to apply is named in the error ("release DIR: ...").
absl::StatusOr<ServedModel> LoadServedModel(const std::string& model_dir, const std::string& release_dir,
                                            ExpertBits bits, kernels::Backend& backend, kernels::Communicator* comm,
                                            model::ModelOptions options, const nvfp4::ServeOptions& nvfp4 = {});

// Model::Load with the routed experts taken from `release_dir` at `bits` (LoadServedModel
// without the decoder; `release_dir` must not be empty).
absl::StatusOr<std::unique_ptr<model::Model>> LoadModelWithRelease(const std::string& model_dir,
                                                                   const std::string& release_dir, ExpertBits bits,
                                                                   kernels::Backend& backend,
                                                                   kernels::Communicator* comm,
                                                                   model::ModelOptions options);

}  // namespace nq::release
