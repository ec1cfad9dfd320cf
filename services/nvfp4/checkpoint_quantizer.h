// `nq nvfp4 quantize`: a bf16/f16/f32 Hugging Face checkpoint -> an NVFP4 checkpoint in the
// layout NVIDIA ModelOpt exports (nvfp4_format.h), shard by shard.
//
// Output directory:
//   the source's shard files (same names; one output shard per source shard, so memory stays
//   bounded by one shard), model.safetensors.index.json when the source is sharded,
//   config.json = the source's plus "quantization_config" {"quant_method": "modelopt",
//   "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": null, "exclude_modules",
//   "producer"}, hf_quant_config.json {"producer", "quantization": {"quant_algo": "NVFP4",
//   "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules"}} (what ModelOpt writes
//   next to its checkpoints), and every other regular file of the source directory copied
//   (tokenizer, generation config).
// A selected weight `<m>.weight` [rows, cols] becomes `<m>.weight` U8 [rows, cols / 2],
// `<m>.weight_scale` F8_E4M3 [rows, cols / 16] and `<m>.weight_scale_2` F32 []; every other
// tensor is copied byte for byte. No `input_scale` is written: this is weight-only
// quantization without calibration data, and a W4A4 consumer needs a calibrated activation
// scale that only data can give.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/nvfp4/nvfp4_quantizer.h"

namespace nq::nvfp4 {

// Routed experts of every layer, the MTP layer's included (hub names
// model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight).
inline constexpr absl::string_view kRoutedExpertPattern = "model.layers.*.mlp.experts.*.*_proj.weight";

// Shell-style match of a whole tensor name: '*' matches any run of characters (dots
// included), '?' one character; nothing else is special.
bool GlobMatch(absl::string_view pattern, absl::string_view text);

struct QuantizeCheckpointOptions {
  std::string model_dir;
  std::string out_dir;  // created if missing; must differ from model_dir
  ScaleSearch search = ScaleSearch::kNonclip;
  // Linear weights (2-D tensors named "*.weight") matching an include pattern and no exclude
  // pattern are quantized; patterns are GlobMatch patterns over full tensor names.
  std::vector<std::string> include = {std::string(kRoutedExpertPattern)};
  std::vector<std::string> exclude;
  std::string tap_path;  // JSON lines, one per quantized tensor (TapLine); empty: none
  int threads = 1;
  // Called after each quantized tensor: (tensors done, tensors selected). For a progress bar.
  std::function<void(int64_t, int64_t)> progress;
};

struct QuantizeCheckpointSummary {
  int shards = 0;
  int64_t quantized_tensors = 0;
  int64_t copied_tensors = 0;
  int64_t quantized_weights = 0;
  double total_sse = 0.0;       // over every quantized weight
  double worst_rel_error = 0.0;
  int64_t clipped_blocks = 0;
  int64_t scale_clamps = 0;
  uint64_t output_bytes = 0;    // tensor data written
};

// Errors: INVALID_ARGUMENT for bad options, a selected tensor that is not floating point or
// whose input dim is not a multiple of 16, or a name that would collide with a scale tensor;
// UNIMPLEMENTED for a source that is already quantized (config.json has quantization_config);
// the checkpoint reader's errors for a bad source; INTERNAL for I/O failures.
absl::StatusOr<QuantizeCheckpointSummary> QuantizeCheckpoint(const QuantizeCheckpointOptions& options);

}  // namespace nq::nvfp4
