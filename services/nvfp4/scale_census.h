// `nq census`: every routed expert's gate_proj and up_proj weight_scale_2 in an NVFP4
// checkpoint, and which pairs differ, read from the safetensors headers and the 4-byte scalar
// values alone (the mapped weights are never touched). A pair that differs is what the fused
// gate/up repack must compensate (gate_up_repack.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace nq::nvfp4 {

struct ExpertScalePair {
  int64_t layer = 0;
  int64_t expert = 0;
  float gate_scale_2 = 0.0f;
  float up_scale_2 = 0.0f;
  double ratio = 1.0;  // up / gate
};

struct LayerCensus {
  int64_t layer = 0;
  int64_t experts = 0;
  int64_t mismatched = 0;
  double worst_ratio = 1.0;  // the ratio (up / gate) farthest from 1 in log terms
};

struct CensusReport {
  std::vector<ExpertScalePair> experts;     // by (layer, expert)
  std::vector<ExpertScalePair> mismatched;  // gate_scale_2 != up_scale_2, by (layer, expert)
  std::vector<LayerCensus> layers;          // layers with experts, ascending
  double worst_ratio = 1.0;                 // over every expert, farthest from 1 in log terms
};

// Scans `model_dir` (a checkpoint directory or file, as model::Checkpoint::Open takes) for
// model.layers.L.mlp.experts.E.{gate,up}_proj.weight_scale_2. A pair is mismatched when the
// two FP32 values differ at all. Errors: the checkpoint's own; INVALID_ARGUMENT naming the
// tensor for a scale that is not one finite positive F32, or a gate scale without its up
// scale (or the reverse); NOT_FOUND when no expert has a weight_scale_2.
absl::StatusOr<CensusReport> RunCensus(const std::string& model_dir);

// {"experts", "mismatched_count", "worst_ratio", "layers": [{layer, experts, mismatched,
// worst_ratio}], "mismatched": [{layer, expert, gate_scale_2, up_scale_2, ratio}]}.
nlohmann::json CensusJson(const CensusReport& report);

// A per-layer table and the totals, for a terminal.
std::string CensusText(const CensusReport& report);

}  // namespace nq::nvfp4
