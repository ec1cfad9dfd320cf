#include "services/nvfp4/served_experts.h"

#include <cstddef>
#include <filesystem>
#include <span>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/tensor_manifest.h"
#include "services/nvfp4/modelopt_config.h"
#include "services/nvfp4/nvfp4_format.h"

namespace nq::nvfp4 {
namespace {

// A layer's experts gathered on the host, experts stacked, before one upload per tensor.
struct HostProjection {
  std::vector<uint8_t> packed;
  std::vector<uint8_t> scales;
  std::vector<float> global;
};

// Input columns [begin, begin + count) of `view` (row-parallel slicing), copied: the rows of a
// column slice are not contiguous. begin and count are whole blocks.
void AppendColumns(const Nvfp4View& view, int64_t begin, int64_t count, HostProjection& out) {
  for (int64_t r = 0; r < view.rows; ++r) {
    const auto packed = view.packed.subspan(r * view.cols / 2 + begin / 2, count / 2);
    const auto scales = view.scales.subspan(r * view.cols / kBlockSize + begin / kBlockSize, count / kBlockSize);
    out.packed.insert(out.packed.end(), packed.begin(), packed.end());
    out.scales.insert(out.scales.end(), scales.begin(), scales.end());
  }
}

absl::StatusOr<kernels::Tensor> Upload(kernels::Backend& backend, std::span<const std::byte> bytes, kernels::DType dtype,
                                       kernels::Shape shape) {
  ASSIGN_OR_RETURN(kernels::Tensor t, backend.Allocate(dtype, std::move(shape)));
  RETURN_IF_ERROR(backend.CopyFromHost(bytes, t));
  return t;
}

absl::StatusOr<kernels::Nvfp4Projection> UploadProjection(kernels::Backend& backend, const HostProjection& h,
                                                          int64_t experts, int64_t rows, int64_t cols) {
  kernels::Nvfp4Projection p;
  ASSIGN_OR_RETURN(p.packed, Upload(backend, std::as_bytes(std::span<const uint8_t>(h.packed)), kernels::DType::kU8,
                                    kernels::Shape{experts, rows, cols / 2}));
  ASSIGN_OR_RETURN(p.scales, Upload(backend, std::as_bytes(std::span<const uint8_t>(h.scales)),
                                    kernels::DType::kF8E4M3, kernels::Shape{experts, rows, cols / kBlockSize}));
  ASSIGN_OR_RETURN(p.global_scales, Upload(backend, std::as_bytes(std::span<const float>(h.global)),
                                           kernels::DType::kF32, kernels::Shape{experts}));
  return p;
}

absl::Status ExpectShape(absl::string_view name, const Nvfp4View& v, int64_t rows, int64_t cols) {
  if (v.rows != rows || v.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": NVFP4 weight of [", v.rows, ", ", v.cols,
                                                   "] (unpacked), the config wants [", rows, ", ", cols, "]"));
  }
  return absl::OkStatus();
}

// The routed experts of the layer at `prefix` ("model.layers.3."), rank tp's slice.
absl::StatusOr<model::Nvfp4Experts> LoadLayer(const model::Checkpoint& checkpoint, const model::ModelConfig& c,
                                              const std::string& prefix, model::TensorParallel tp,
                                              const ServeOptions& options, kernels::Backend& backend,
                                              ServedExpertsSummary& summary) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, E = c.n_routed_experts, W = tp.world_size;
  const int64_t Ir = I / W;
  HostProjection gate_up, down;
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = absl::StrCat(prefix, "mlp.experts.", e, ".");
    ASSIGN_OR_RETURN(const Nvfp4View gate, ReadNvfp4(checkpoint, p + "gate_proj.weight"));
    ASSIGN_OR_RETURN(const Nvfp4View up, ReadNvfp4(checkpoint, p + "up_proj.weight"));
    ASSIGN_OR_RETURN(const Nvfp4View dn, ReadNvfp4(checkpoint, p + "down_proj.weight"));
    RETURN_IF_ERROR(ExpectShape(p + "gate_proj.weight", gate, I, D));
    RETURN_IF_ERROR(ExpectShape(p + "up_proj.weight", up, I, D));
    RETURN_IF_ERROR(ExpectShape(p + "down_proj.weight", dn, D, I));
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      if (checkpoint.Contains(absl::StrCat(p, proj, ".input_scale"))) ++summary.ignored_input_scales;
    }
    absl::StatusOr<FusedGateUp> fused =
        RepackGateUp(gate, up, {.mode = options.gate_up, .tp_rank = tp.rank, .tp_size = tp.world_size});
    if (!fused.ok()) return Annotate(fused.status(), p + "gate_proj/up_proj");
    summary.rescaled_blocks += fused->rescaled_blocks;
    summary.clamped_blocks += fused->clamped_blocks;
    gate_up.packed.insert(gate_up.packed.end(), fused->tensor.packed.begin(), fused->tensor.packed.end());
    gate_up.scales.insert(gate_up.scales.end(), fused->tensor.scales.begin(), fused->tensor.scales.end());
    gate_up.global.push_back(fused->tensor.scale_2);
    AppendColumns(dn, tp.rank * Ir, Ir, down);
    down.global.push_back(dn.scale_2);
  }
  model::Nvfp4Experts experts;
  experts.weights.hidden = D;
  experts.weights.intermediate = Ir;
  experts.weights.num_experts = E;
  ASSIGN_OR_RETURN(experts.weights.gate_up, UploadProjection(backend, gate_up, E, 2 * Ir, D));
  ASSIGN_OR_RETURN(experts.weights.down, UploadProjection(backend, down, E, D, Ir));
  experts.bytes = static_cast<int64_t>(gate_up.packed.size() + gate_up.scales.size() + down.packed.size() +
                                       down.scales.size() + (gate_up.global.size() + down.global.size()) * sizeof(float));
  return experts;
}

// Only the routed experts have an NVFP4 kernel: any other packed module is refused by name
// (the dense loader would otherwise report a bare dtype error, or skip an unused one).
absl::Status CheckOnlyExpertsAreNvfp4(const model::Checkpoint& checkpoint) {
  for (const std::string& name : checkpoint.Names()) {
    if (!absl::EndsWith(name, ".weight_scale_2") || absl::StrContains(name, ".mlp.experts.")) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        name, ": NVFP4 outside the routed experts is not served (quantize with the default patterns, which keep "
              "every other module in its source dtype)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> IsNvfp4Checkpoint(const std::string& model_dir, const model::ModelConfig& config) {
  const bool in_config =
      config.quantization.has_value() && config.quantization->method == model::QuantMethod::kModeloptNvfp4;
  if (!std::filesystem::exists(std::filesystem::path(model_dir) / std::string(kHfQuantConfigName))) {
    return in_config;
  }
  ASSIGN_OR_RETURN(const ModeloptInfo info, ReadHfQuantConfig(model_dir));
  const std::string file = (std::filesystem::path(model_dir) / std::string(kHfQuantConfigName)).string();
  if (info.quant_algo != kQuantAlgo) {
    return absl::UnimplementedError(
        absl::StrCat(file, ": quant_algo \"", info.quant_algo, "\" is not served; supported: ", kQuantAlgo));
  }
  if (info.group_size != kBlockSize) {
    return absl::UnimplementedError(
        absl::StrCat(file, ": group_size ", info.group_size, " is not served; NVFP4 blocks are ", kBlockSize));
  }
  if (config.quantization.has_value() && !in_config) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, " says NVFP4 but config.json's quantization_config names another method"));
  }
  return true;
}

absl::StatusOr<ServedExpertsSummary> LoadNvfp4Experts(const model::Checkpoint& checkpoint,
                                                      const model::ModelConfig& config, model::TensorParallel tp,
                                                      const ServeOptions& options, kernels::Backend& backend,
                                                      model::ModelWeights& weights) {
  RETURN_IF_ERROR(CheckOnlyExpertsAreNvfp4(checkpoint));
  const int64_t I = config.moe_intermediate_size, W = tp.world_size;
  if (W < 1 || I % W != 0 || (I / W) % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("NVFP4 experts: moe_intermediate_size ", I, " over ", W,
                                                   " ranks is not a whole number of ", kBlockSize,
                                                   "-element blocks per rank (down_proj is split on its input columns)"));
  }
  ServedExpertsSummary summary;
  summary.experts = config.n_routed_experts;
  auto load = [&](model::LayerWeights& lw, int64_t layer) -> absl::Status {
    if (!lw.moe.has_value()) return absl::OkStatus();
    ASSIGN_OR_RETURN(model::Nvfp4Experts experts,
                     LoadLayer(checkpoint, config, model::LayerPrefix(layer), tp, options, backend, summary));
    summary.bytes += experts.bytes;
    ++summary.layers;
    lw.moe->experts.clear();
    lw.moe->nvfp4 = std::move(experts);
    return absl::OkStatus();
  };
  for (size_t l = 0; l < weights.layers.size(); ++l) RETURN_IF_ERROR(load(weights.layers[l], static_cast<int64_t>(l)));
  for (size_t i = 0; i < weights.mtp.size(); ++i) {
    RETURN_IF_ERROR(load(weights.mtp[i].block, config.num_hidden_layers + static_cast<int64_t>(i)));
  }
  return summary;
}

}  // namespace nq::nvfp4
