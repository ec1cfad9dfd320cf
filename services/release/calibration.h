// `nq calibrate`: runs the model over calibration tokens and accumulates, per routed expert,
// the input Hessians H = X^T X / n of its gate/up input and of its down_proj input, and how
// often the router chose it. `nq encode --calib` reads them back: LDLQ error feedback per
// expert, and the expert ranking (and default fixed set) by routing counts.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "services/common/progress.h"
#include "services/quant/ldlq.h"

namespace nq::release {

struct ExpertHessians {
  quant::Hessian gate_up;  // hidden_size x hidden_size
  quant::Hessian down;     // moe_intermediate_size x moe_intermediate_size
  double samples = 0;      // token rows that reached the expert
};

struct Calibration {
  std::map<std::pair<uint32_t, uint32_t>, ExpertHessians> experts;  // (layer, expert)
  std::map<uint32_t, std::vector<double>> routing_counts;          // layer -> per expert
};

// Sequences are run one by one from an empty cache. Writes a safetensors file to `out_path`.
// `progress` (may be empty) hears after each sequence: sequences done, tokens as the work.
absl::StatusOr<Calibration> Calibrate(const std::string& model_dir, const std::vector<std::vector<int32_t>>& sequences,
                                      const std::string& out_path,
                                      const std::function<void(const ProgressState&)>& progress = {});
absl::StatusOr<Calibration> LoadCalibration(const std::string& path);
// Token ids, one sequence per line, comma or space separated.
absl::StatusOr<std::vector<std::vector<int32_t>>> ReadTokenFile(const std::string& path);

}  // namespace nq::release
