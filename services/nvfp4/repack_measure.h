// The measurement behind bench/README.md's repack table (`nq nvfp4 repack-error`): for every
// routed expert of an NVFP4 checkpoint whose gate and up global scales differ, the error of
// the fused gate/up matrix under each GateUpScaleMode against the unquantized weights, and
// against the same expert quantized with one shared (matched) global scale.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/nvfp4/gate_up_repack.h"
#include "services/nvfp4/nvfp4_quantizer.h"

namespace nq::nvfp4 {

struct RepackModeError {
  GateUpScaleMode mode = GateUpScaleMode::kCompensate;
  double gate_mse = 0.0;  // per weight, over every measured expert and rank
  double up_mse = 0.0;
};

struct RepackMeasurement {
  int64_t experts = 0;             // routed experts in the checkpoint
  int64_t measured_experts = 0;    // those with gate_scale_2 != up_scale_2
  double worst_ratio = 1.0;        // up / gate, farthest from 1
  double unfused_gate_mse = 0.0;   // each half dequantized with its own global: the floor
  double unfused_up_mse = 0.0;
  double matched_gate_mse = 0.0;   // requantized from the reference at one shared global
  double matched_up_mse = 0.0;
  std::vector<RepackModeError> modes;  // compensate, requantize, gate_only
};

struct RepackMeasureOptions {
  std::string nvfp4_dir;      // an NVFP4 checkpoint (nq nvfp4 quantize output)
  std::string reference_dir;  // the unquantized checkpoint it was made from
  int tp_size = 1;            // every rank's shard is repacked and measured
  ScaleSearch matched_search = ScaleSearch::kNonclip;  // for the matched-scale baseline
};

// Errors: the census's and the checkpoints'; INVALID_ARGUMENT when a reference tensor's shape
// differs from the NVFP4 one or tp_size does not divide the expert width; NOT_FOUND when no
// expert has mismatched scales (nothing to measure).
absl::StatusOr<RepackMeasurement> MeasureRepackError(const RepackMeasureOptions& options);

}  // namespace nq::nvfp4
