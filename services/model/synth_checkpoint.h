// Random-weight checkpoints in the HF hub layout for any config of either architecture
// (`nq synth-model`): demos, tests, and benchmarks at real shapes.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "services/model/model_config.h"

namespace nq::model {

enum class SynthDtype {
  kF32,
  kBF16,  // as the bf16 hub checkpoints (e_score_correction_bias stays float32)
  kFp8,   // as the FP8 hub checkpoints: F8_E4M3 linears with 128x128 weight_scale_inv
};

struct SynthOptions {
  SynthDtype dtype = SynthDtype::kF32;
  uint64_t seed = 0;
  // Split model.safetensors into shards of at most this many bytes (with
  // model.safetensors.index.json); 0 writes one file.
  uint64_t max_shard_bytes = 0;
  // false: no routed expert tensors (model.layers.L.mlp.experts.*), as a checkpoint served with
  // its experts from a NestQuant release may be; shared experts stay. `nq synth-release` then
  // writes the release: the two make slices at real sizes whose experts would not fit a BF16 file.
  bool routed_experts = true;
};

// Writes config.json (with quantization_config for FP8), generation_config.json and the
// weights into `out_dir` (created if missing). Linear weights are N(0, 1/in), norms near 1,
// embeddings N(0, 1), the router's correction bias small and nonzero, so routing and DSA
// selection are not degenerate. Deterministic for a seed.
absl::Status WriteSyntheticCheckpoint(ModelConfig config, const std::string& out_dir,
                                      const SynthOptions& options);

}  // namespace nq::model
