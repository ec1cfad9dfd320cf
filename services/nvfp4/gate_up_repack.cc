#include "services/nvfp4/gate_up_repack.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/dtype_convert.h"

namespace nq::nvfp4 {
namespace {

// Appends `half` to `out` with its block scales multiplied by `factor` (1: copied as is).
void AppendRescaled(const Nvfp4View& half, float factor, Nvfp4Tensor& out, FusedGateUp& result) {
  out.packed.insert(out.packed.end(), half.packed.begin(), half.packed.end());
  if (factor == 1.0f) {
    out.scales.insert(out.scales.end(), half.scales.begin(), half.scales.end());
    return;
  }
  for (uint8_t code : half.scales) {
    const float value = kernels::E4M3ToFloat(code);
    if (value == 0.0f) {  // a zero scale codes an all-zero block at any global
      out.scales.push_back(code);
      continue;
    }
    const float rescaled = value * factor;
    const float clamped = std::clamp(rescaled, kScaleMin, kScaleMax);
    result.clamped_blocks += clamped != rescaled ? 1 : 0;
    ++result.rescaled_blocks;
    out.scales.push_back(model::FloatToFp8E4M3(clamped));
  }
}

// Appends `half` requantized at `scale_2`.
absl::Status AppendRequantized(const Nvfp4View& half, float scale_2, ScaleSearch search, Nvfp4Tensor& out,
                               FusedGateUp& result) {
  ASSIGN_OR_RETURN(const std::vector<float> values, Dequantize(half));
  QuantizeOptions options;
  options.search = search;
  options.scale_2 = scale_2;
  ASSIGN_OR_RETURN(QuantizeResult q, QuantizeNvfp4(values, half.rows, half.cols, options));
  out.packed.insert(out.packed.end(), q.tensor.packed.begin(), q.tensor.packed.end());
  out.scales.insert(out.scales.end(), q.tensor.scales.begin(), q.tensor.scales.end());
  result.rescaled_blocks += q.stats.blocks;
  result.clamped_blocks += q.stats.scale_clamps;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GateUpScaleMode> ParseGateUpScaleMode(absl::string_view text) {
  if (text == "compensate") return GateUpScaleMode::kCompensate;
  if (text == "requantize") return GateUpScaleMode::kRequantize;
  if (text == "gate_only") return GateUpScaleMode::kGateOnly;
  return absl::InvalidArgumentError(
      absl::StrCat("gate/up scale mode: want compensate, requantize or gate_only, got '", text, "'"));
}

absl::string_view GateUpScaleModeName(GateUpScaleMode mode) {
  switch (mode) {
    case GateUpScaleMode::kCompensate: return "compensate";
    case GateUpScaleMode::kRequantize: return "requantize";
    case GateUpScaleMode::kGateOnly: return "gate_only";
  }
  return "?";
}

Nvfp4View SliceRows(const Nvfp4View& view, int64_t begin, int64_t count) {
  Nvfp4View slice = view;
  slice.rows = count;
  slice.packed = view.packed.subspan(begin * view.cols / 2, count * view.cols / 2);
  slice.scales = view.scales.subspan(begin * view.cols / kBlockSize, count * view.cols / kBlockSize);
  return slice;
}

absl::StatusOr<FusedGateUp> RepackGateUp(const Nvfp4View& gate, const Nvfp4View& up, const RepackOptions& options) {
  RETURN_IF_ERROR(Annotate(ValidateView(gate), "gate_proj"));
  RETURN_IF_ERROR(Annotate(ValidateView(up), "up_proj"));
  if (gate.rows != up.rows || gate.cols != up.cols) {
    return absl::InvalidArgumentError(absl::StrCat("gate/up repack: gate [", gate.rows, ", ", gate.cols, "] and up [",
                                                   up.rows, ", ", up.cols, "] differ"));
  }
  if (options.tp_size < 1 || options.tp_rank < 0 || options.tp_rank >= options.tp_size ||
      gate.rows % options.tp_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gate/up repack: rank ", options.tp_rank, " of ", options.tp_size,
                                                   " cannot split ", gate.rows, " rows evenly"));
  }
  const int64_t shard_rows = gate.rows / options.tp_size;
  const int64_t begin = shard_rows * options.tp_rank;
  const Nvfp4View gate_shard = SliceRows(gate, begin, shard_rows);
  const Nvfp4View up_shard = SliceRows(up, begin, shard_rows);

  FusedGateUp result;
  Nvfp4Tensor& out = result.tensor;
  out.rows = 2 * shard_rows;
  out.cols = gate.cols;
  out.packed.reserve(gate_shard.packed.size() * 2);
  out.scales.reserve(gate_shard.scales.size() * 2);
  const float fused = options.mode == GateUpScaleMode::kGateOnly ? gate.scale_2 : std::max(gate.scale_2, up.scale_2);
  out.scale_2 = fused;
  for (const Nvfp4View* half : {&gate_shard, &up_shard}) {
    switch (options.mode) {
      case GateUpScaleMode::kGateOnly:
        AppendRescaled(*half, 1.0f, out, result);
        break;
      case GateUpScaleMode::kCompensate:
        AppendRescaled(*half, half->scale_2 == fused ? 1.0f : half->scale_2 / fused, out, result);
        break;
      case GateUpScaleMode::kRequantize:
        if (half->scale_2 == fused) {
          AppendRescaled(*half, 1.0f, out, result);
        } else {
          RETURN_IF_ERROR(AppendRequantized(*half, fused, options.requantize_search, out, result));
        }
        break;
    }
  }
  return result;
}

}  // namespace nq::nvfp4
