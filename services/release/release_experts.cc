#include "services/release/release_experts.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/nvfp4/served_experts.h"
#include "services/quant/codec.h"
#include "services/release/release_encoder.h"
#include "services/release/packed_experts.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

absl::StatusOr<ExpertBits> ParseExpertBits(const std::string& text) {
  if (text == "2") return ExpertBits::k2Bit;
  if (text == "4") return ExpertBits::k4Bit;
  if (text == "fixed") return ExpertBits::kFixedSet;
  return absl::InvalidArgumentError("expert bits '" + text + "': want 2, 4 or fixed");
}

absl::Status ApplyReleaseExperts(const ReleaseExpertDecoder& decoder, const model::ModelConfig& config,
                                 ExpertBits bits, kernels::Backend& backend, model::ModelWeights& weights) {
  for (uint32_t layer : decoder.moe_layer_ids()) {
    // A checkpoint that dropped its MTP layers (ModelWeights::mtp_missing) leaves the release's
    // MTP experts with nothing to attach to: they go unused, as the layer does.
    if (layer >= config.num_hidden_layers && static_cast<size_t>(layer - config.num_hidden_layers) >= weights.mtp.size()) continue;
    model::LayerWeights& lw = layer < config.num_hidden_layers
                                  ? weights.layers[layer]
                                  : weights.mtp[layer - config.num_hidden_layers].block;
    if (!lw.moe.has_value()) return absl::InternalError(absl::StrCat("layer ", layer, " of the release is not MoE"));
    ASSIGN_OR_RETURN(model::PackedExperts packed, LoadPackedExperts(decoder, layer, backend));
    std::vector<uint32_t> four;
    if (bits == ExpertBits::k4Bit) {
      for (uint32_t e = 0; e < static_cast<uint32_t>(config.n_routed_experts); ++e) four.push_back(e);
    } else if (bits == ExpertBits::kFixedSet) {
      four = decoder.FixedSet(layer);
    }
    RETURN_IF_ERROR(AttachRecords(decoder, layer, four, backend, packed));
    // Routed experts live only as the release's codes: any dense copy goes.
    lw.moe->experts.clear();
    lw.moe->packed = std::move(packed);
  }
  return absl::OkStatus();
}

namespace {

// An NVFP4 checkpoint: every weight as Model::Load reads it except the routed experts, which
// stay packed.
absl::StatusOr<std::unique_ptr<model::Model>> LoadNvfp4Model(const std::string& model_dir, model::ModelConfig config,
                                                             kernels::Backend& backend, kernels::Communicator* comm,
                                                             const model::ModelOptions& options,
                                                             const nvfp4::ServeOptions& nvfp4) {
  const std::string context = "NVFP4 checkpoint " + model_dir;
  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(model_dir);
  if (!checkpoint.ok()) return Annotate(checkpoint.status(), context);
  absl::StatusOr<model::ModelWeights> weights =
      model::LoadModelWeights(*checkpoint, config, backend, options.tp,
                              {.routed_experts = false, .matrix_dtype = options.weight_dtype});
  if (!weights.ok()) return Annotate(weights.status(), context);
  absl::StatusOr<nvfp4::ServedExpertsSummary> summary =
      nvfp4::LoadNvfp4Experts(*checkpoint, config, options.tp, nvfp4, backend, *weights);
  if (!summary.ok()) return Annotate(summary.status(), context);
  spdlog::info("NVFP4 routed experts: {} layers x {} experts, {:.1f} MiB on rank {}; gate/up fused with {} ({} block "
               "scales rescaled, {} clamped)",
               summary->layers, summary->experts, static_cast<double>(summary->bytes) / (1 << 20), options.tp.rank,
               std::string(nvfp4::GateUpScaleModeName(nvfp4.gate_up)), summary->rescaled_blocks,
               summary->clamped_blocks);
  if (summary->ignored_input_scales > 0) {
    spdlog::warn("NVFP4 checkpoint {} has {} input_scale tensors (W4A4): served weight-only, activations unquantized",
                 model_dir, summary->ignored_input_scales);
  }
  return model::Model::Create(std::move(config), *std::move(weights), backend, comm, options);
}

}  // namespace

absl::StatusOr<ServedModel> LoadServedModel(const std::string& model_dir, const std::string& release_dir,
                                            ExpertBits bits, kernels::Backend& backend, kernels::Communicator* comm,
                                            model::ModelOptions options, const nvfp4::ServeOptions& nvfp4) {
  ServedModel served;
  ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(model_dir));
  if (release_dir.empty()) {
    absl::StatusOr<bool> is_nvfp4 = nvfp4::IsNvfp4Checkpoint(model_dir, config);
    if (!is_nvfp4.ok()) return Annotate(is_nvfp4.status(), "NVFP4 checkpoint " + model_dir);
    if (!*is_nvfp4) {
      ASSIGN_OR_RETURN(served.model, model::Model::Load(model_dir, backend, comm, options));
      return served;
    }
    ASSIGN_OR_RETURN(served.model, LoadNvfp4Model(model_dir, std::move(config), backend, comm, options, nvfp4));
    return served;
  }
  absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> opened =
      ReleaseExpertDecoder::Open(release_dir, model_dir, config, options.tp);
  if (!opened.ok()) return Annotate(opened.status(), "release " + release_dir);
  served.decoder = *std::move(opened);
  ASSIGN_OR_RETURN(model::Checkpoint checkpoint, model::Checkpoint::Open(model_dir));
  // Routed experts come from the release alone (a checkpoint without them serves).
  ASSIGN_OR_RETURN(model::ModelWeights weights,
                   model::LoadModelWeights(checkpoint, config, backend, options.tp,
                                           {.routed_experts = false, .matrix_dtype = options.weight_dtype}));
  absl::Status applied = ApplyReleaseExperts(*served.decoder, config, bits, backend, weights);
  if (!applied.ok()) return Annotate(applied, "release " + release_dir);
  ASSIGN_OR_RETURN(served.model, model::Model::Create(std::move(config), std::move(weights), backend, comm, options));
  return served;
}

absl::StatusOr<std::unique_ptr<model::Model>> LoadModelWithRelease(const std::string& model_dir,
                                                                   const std::string& release_dir, ExpertBits bits,
                                                                   kernels::Backend& backend,
                                                                   kernels::Communicator* comm,
                                                                   model::ModelOptions options) {
  if (release_dir.empty()) return absl::InvalidArgumentError("LoadModelWithRelease: no release directory");
  ASSIGN_OR_RETURN(ServedModel served, LoadServedModel(model_dir, release_dir, bits, backend, comm, options));
  return std::move(served.model);
}

}  // namespace nq::release
