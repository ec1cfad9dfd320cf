#include "services/nvfp4/repack_measure.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/dtype_convert.h"
#include "services/model/safetensors.h"
#include "services/nvfp4/nvfp4_format.h"
#include "services/nvfp4/scale_census.h"

namespace nq::nvfp4 {
namespace {

double Sse(std::span<const float> a, std::span<const float> b) {
  double sse = 0;
  for (size_t i = 0; i < a.size(); ++i) sse += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
  return sse;
}

absl::StatusOr<std::vector<float>> ReadReference(const model::Checkpoint& reference, const std::string& name,
                                                 const Nvfp4View& quantized) {
  ASSIGN_OR_RETURN(const model::TensorView view, reference.Find(name));
  if (view.shape.size() != 2 || view.shape[0] != quantized.rows || view.shape[1] != quantized.cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the reference's shape differs from the NVFP4 tensor's"));
  }
  return model::ConvertToFloat32(view.dtype, view.data);
}

struct Sums {
  double gate = 0, up = 0;
};

}  // namespace

absl::StatusOr<RepackMeasurement> MeasureRepackError(const RepackMeasureOptions& options) {
  ASSIGN_OR_RETURN(const CensusReport census, RunCensus(options.nvfp4_dir));
  if (census.mismatched.empty()) {
    return absl::NotFoundError(absl::StrCat(options.nvfp4_dir, ": no expert has mismatched gate/up global scales"));
  }
  ASSIGN_OR_RETURN(const model::Checkpoint nvfp4, model::Checkpoint::Open(options.nvfp4_dir));
  ASSIGN_OR_RETURN(const model::Checkpoint reference, model::Checkpoint::Open(options.reference_dir));
  const GateUpScaleMode modes[] = {GateUpScaleMode::kCompensate, GateUpScaleMode::kRequantize,
                                   GateUpScaleMode::kGateOnly};
  std::vector<Sums> mode_sums(std::size(modes));
  Sums unfused, matched;
  int64_t weights_per_half = 0;
  for (const ExpertScalePair& pair : census.mismatched) {
    const std::string prefix = absl::StrCat("model.layers.", pair.layer, ".mlp.experts.", pair.expert, ".");
    ASSIGN_OR_RETURN(const Nvfp4View gate, ReadNvfp4(nvfp4, prefix + "gate_proj.weight"));
    ASSIGN_OR_RETURN(const Nvfp4View up, ReadNvfp4(nvfp4, prefix + "up_proj.weight"));
    ASSIGN_OR_RETURN(const std::vector<float> gate_ref, ReadReference(reference, prefix + "gate_proj.weight", gate));
    ASSIGN_OR_RETURN(const std::vector<float> up_ref, ReadReference(reference, prefix + "up_proj.weight", up));
    const int64_t half = gate.rows * gate.cols;
    weights_per_half += half;

    ASSIGN_OR_RETURN(const std::vector<float> gate_own, Dequantize(gate));
    ASSIGN_OR_RETURN(const std::vector<float> up_own, Dequantize(up));
    unfused.gate += Sse(gate_own, gate_ref);
    unfused.up += Sse(up_own, up_ref);

    QuantizeOptions shared;
    shared.search = options.matched_search;
    // One shared global, the larger one; widened by ulps if float rounding would make a
    // checkpoint written with `off` clip under nonclip's check.
    float amax = 0;
    for (const std::vector<float>* ref : {&gate_ref, &up_ref}) {
      for (float v : *ref) amax = std::max(amax, std::fabs(v));
    }
    float scale_2 = std::max(gate.scale_2, up.scale_2);
    while (amax / (kScaleMax * scale_2) > kE2M1Max) scale_2 = std::nextafter(scale_2, 1.0f);
    shared.scale_2 = scale_2;
    for (const auto& [ref, sum] : {std::pair{&gate_ref, &matched.gate}, std::pair{&up_ref, &matched.up}}) {
      ASSIGN_OR_RETURN(const QuantizeResult q, QuantizeNvfp4(*ref, gate.rows, gate.cols, shared));
      *sum += q.stats.mse * static_cast<double>(half);
    }

    for (size_t m = 0; m < std::size(modes); ++m) {
      for (int rank = 0; rank < options.tp_size; ++rank) {
        RepackOptions repack;
        repack.mode = modes[m];
        repack.tp_rank = rank;
        repack.tp_size = options.tp_size;
        ASSIGN_OR_RETURN(const FusedGateUp fused, RepackGateUp(gate, up, repack));
        ASSIGN_OR_RETURN(const std::vector<float> values, Dequantize(fused.tensor.view()));
        const int64_t shard = gate.rows / options.tp_size * gate.cols;
        const std::span<const float> all(values);
        mode_sums[m].gate += Sse(all.subspan(0, shard), std::span<const float>(gate_ref).subspan(rank * shard, shard));
        mode_sums[m].up += Sse(all.subspan(shard, shard), std::span<const float>(up_ref).subspan(rank * shard, shard));
      }
    }
  }
  RepackMeasurement out;
  out.experts = static_cast<int64_t>(census.experts.size());
  out.measured_experts = static_cast<int64_t>(census.mismatched.size());
  out.worst_ratio = census.worst_ratio;
  const double n = static_cast<double>(weights_per_half);
  out.unfused_gate_mse = unfused.gate / n;
  out.unfused_up_mse = unfused.up / n;
  out.matched_gate_mse = matched.gate / n;
  out.matched_up_mse = matched.up / n;
  for (size_t m = 0; m < std::size(modes); ++m) {
    out.modes.push_back({modes[m], mode_sums[m].gate / n, mode_sums[m].up / n});
  }
  return out;
}

}  // namespace nq::nvfp4
