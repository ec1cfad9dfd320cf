#include "services/release/release_experts.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/quant/codec.h"
#include "services/release/release_encoder.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

absl::StatusOr<ExpertBits> ParseExpertBits(const std::string& text) {
  if (text == "2") return ExpertBits::k2Bit;
  if (text == "4") return ExpertBits::k4Bit;
  if (text == "fixed") return ExpertBits::kFixedSet;
  return absl::InvalidArgumentError("expert bits '" + text + "': want 2, 4 or fixed");
}

absl::Status ApplyReleaseExperts(const std::string& release_dir, const std::string& model_dir,
                                 const model::ModelConfig& config, model::TensorParallel tp, ExpertBits bits,
                                 kernels::Backend& backend, model::ModelWeights& weights) {
  ASSIGN_OR_RETURN(std::unique_ptr<ReleaseExpertDecoder> decoder,
                   ReleaseExpertDecoder::Open(release_dir, model_dir, config, tp));
  return ApplyReleaseExperts(*decoder, config, bits, backend, weights);
}

absl::Status ApplyReleaseExperts(const ReleaseExpertDecoder& decoder, const model::ModelConfig& config,
                                 ExpertBits bits, kernels::Backend& backend, model::ModelWeights& weights) {
  for (uint32_t layer : decoder.moe_layer_ids()) {
    const std::vector<uint32_t> fixed = decoder.FixedSet(layer);
    model::LayerWeights& lw = layer < config.num_hidden_layers
                                  ? weights.layers[layer]
                                  : weights.mtp[layer - config.num_hidden_layers].block;
    for (uint32_t e = 0; e < static_cast<uint32_t>(config.n_routed_experts); ++e) {
      const bool four = bits == ExpertBits::k4Bit ||
                        (bits == ExpertBits::kFixedSet && std::find(fixed.begin(), fixed.end(), e) != fixed.end());
      ASSIGN_OR_RETURN(lw.moe->experts[e],
                       decoder.Upload(layer, e, four ? quant::Precision::k4Bit : quant::Precision::k2Bit, {}, backend));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<model::Model>> LoadModelWithRelease(const std::string& model_dir,
                                                                   const std::string& release_dir, ExpertBits bits,
                                                                   kernels::Backend& backend,
                                                                   kernels::Communicator* comm,
                                                                   model::ModelOptions options) {
  ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(model::Checkpoint checkpoint, model::Checkpoint::Open(model_dir));
  ASSIGN_OR_RETURN(model::ModelWeights weights, model::LoadModelWeights(checkpoint, config, backend, options.tp));
  absl::Status applied = ApplyReleaseExperts(release_dir, model_dir, config, options.tp, bits, backend, weights);
  if (!applied.ok()) return Annotate(applied, "release " + release_dir);
  return model::Model::Create(std::move(config), std::move(weights), backend, comm, options);
}

}  // namespace nq::release
