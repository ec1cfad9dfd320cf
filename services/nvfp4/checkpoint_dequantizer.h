// `nq nvfp4 dequantize`: an NVFP4 checkpoint (ModelOpt layout) -> a plain checkpoint with
// every NVFP4 weight expanded to F32, exactly its dequantised values. Until the worker serves
// NVFP4 experts natively this is how the CPU engine (`nq logits`) runs an NVFP4 checkpoint,
// which is what bench/README.md's KL figures rest on.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace nq::nvfp4 {

struct DequantizeCheckpointSummary {
  int64_t dequantized_tensors = 0;
  int64_t copied_tensors = 0;
};

// Every `<m>.weight` stored as U8 next to `<m>.weight_scale` and `<m>.weight_scale_2` becomes
// F32 [rows, 2 * packed cols]; its scale tensors (and any `<m>.input_scale`) are dropped; every
// other tensor is copied byte for byte, shard for shard. config.json loses its
// "quantization_config"; hf_quant_config.json is not copied; other files are.
// Errors: the readers' (ReadNvfp4, the checkpoint's); INVALID_ARGUMENT for out == model;
// INTERNAL on I/O failure.
absl::StatusOr<DequantizeCheckpointSummary> DequantizeCheckpoint(const std::string& model_dir,
                                                                 const std::string& out_dir);

}  // namespace nq::nvfp4
