// Helpers shared by the files that implement model_config.h (parsing, validation, JSON
// writing): the sanity limits, the architecture names, status builders, and the dense/MoE
// layer-kind helpers. Not part of the library's interface.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "services/model/model_config.h"

namespace nq::model::config_internal {

// Sanity bounds that keep a corrupt config from sizing per-layer tables or products of
// dimensions absurdly. Real models: < 200 layers, dimensions < 2^20.
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxSize = int64_t{1} << 24;

constexpr char kGlmMoeDsaName[] = "GlmMoeDsaForCausalLM";
constexpr char kDeepseekV3Name[] = "DeepseekV3ForCausalLM";

inline absl::Status Invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }
inline absl::Status Unimplemented(auto&&... parts) {
  return absl::UnimplementedError(absl::StrCat(parts...));
}

inline absl::Status CheckRange(const char* name, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    return Invalid(name, " ", value, " is outside [", min, ", ", max, "]");
  }
  return absl::OkStatus();
}

// Layers 0..first_k_dense-1 dense, the rest MoE: how DeepseekV3 lays out its layers.
inline std::vector<MlpKind> DenseThenMoe(int64_t num_layers, int64_t first_k_dense) {
  std::vector<MlpKind> kinds(num_layers, MlpKind::kMoe);
  for (int64_t i = 0; i < first_k_dense && i < num_layers; ++i) kinds[i] = MlpKind::kDense;
  return kinds;
}

// How many layers at the start are dense (first_k_dense_replace).
inline int64_t LeadingDense(const std::vector<MlpKind>& kinds) {
  int64_t count = 0;
  while (count < static_cast<int64_t>(kinds.size()) && kinds[count] == MlpKind::kDense) ++count;
  return count;
}

}  // namespace nq::model::config_internal
