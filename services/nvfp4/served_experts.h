// Serving an NVFP4 checkpoint's routed experts (issue #20): every MoE layer's experts stay packed
// (E2M1 codes, E4M3 block scales, one global per expert and projection) on the backend and run
// through Backend::Nvfp4Moe, never expanded. The rest of the model loads as from any checkpoint
// (services/model/model_weights.h); only the routed experts may be NVFP4.
//
// Per tensor-parallel rank: gate/up are column-parallel and fused under one global scale by
// RepackGateUp (gate_up_repack.h: --nvfp4_gate_up_scale, compensate by default); down is
// row-parallel: rank r keeps input columns [r I / W, (r + 1) I / W), whole 16-element blocks, its
// global scale unchanged.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/model/model_config.h"
#include "services/model/model_weights.h"
#include "services/model/safetensors.h"
#include "services/nvfp4/gate_up_repack.h"

namespace nq::nvfp4 {

struct ServeOptions {
  GateUpScaleMode gate_up = GateUpScaleMode::kCompensate;
};

// Whether `model_dir` (whose config.json parsed into `config`) is an NVFP4 checkpoint: its
// config.json says quant_method "modelopt" / quant_algo "NVFP4", or hf_quant_config.json is there.
// hf_quant_config.json that is malformed is INVALID_ARGUMENT, one naming another algorithm or
// group size UNIMPLEMENTED, each naming the file.
absl::StatusOr<bool> IsNvfp4Checkpoint(const std::string& model_dir, const model::ModelConfig& config);

// What LoadNvfp4Experts did, for the caller's log line.
struct ServedExpertsSummary {
  int64_t layers = 0;
  int64_t experts = 0;             // per layer
  int64_t bytes = 0;               // codes and scales on the backend, this rank
  int64_t rescaled_blocks = 0;     // gate/up block scales the repack rewrote (compensate, requantize)
  int64_t clamped_blocks = 0;      // of those, clamped to [2^-9, 448]
  int64_t ignored_input_scales = 0;  // W4A4 input_scale tensors: activations are not quantized here
};

// Gives every MoE layer of `weights` (decoder layers and the MTP layers loaded) its routed
// experts from `checkpoint`, rank `tp`'s slice, as MoeWeights::nvfp4 (dense experts, if any, are
// dropped). Errors name the tensor: NOT_FOUND for a missing weight or scale; INVALID_ARGUMENT for a
// wrong dtype or shape, a non-finite or non-positive weight_scale_2, or an intermediate size
// whose rank slice is not whole blocks; FAILED_PRECONDITION for NVFP4 tensors outside the routed
// experts (served by no kernel here).
absl::StatusOr<ServedExpertsSummary> LoadNvfp4Experts(const model::Checkpoint& checkpoint,
                                                      const model::ModelConfig& config, model::TensorParallel tp,
                                                      const ServeOptions& options, kernels::Backend& backend,
                                                      model::ModelWeights& weights);

}  // namespace nq::nvfp4
