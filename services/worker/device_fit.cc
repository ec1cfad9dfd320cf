#include "services/worker/device_fit.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/fp8_block_quantize.h"
#include "services/common/status_macros.h"
#include "services/model/absorbed_dtype.h"
#include "services/model/kv_cache.h"

namespace nq::worker {
namespace {

std::string GiB(uint64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30)); }

// The decoder layer a tensor belongs to ("model.layers.<L>.…"), or -1.
int64_t LayerOf(absl::string_view name) {
  constexpr absl::string_view kPrefix = "model.layers.";
  if (!absl::StartsWith(name, kPrefix)) return -1;
  name.remove_prefix(kPrefix.size());
  int64_t layer = -1;
  if (!absl::SimpleAtoi(name.substr(0, name.find('.')), &layer)) return -1;
  return layer;
}

// Tensors the loader folds into others rather than keeping: FP8 block scales.
bool IsFoldedScale(absl::string_view name) {
  return absl::EndsWith(name, "_scale_inv") || absl::EndsWith(name, ".weight_scale");
}

// Bytes the loader stores the tensor in (model_weights.cc): the 2-D weights only MatMul reads at
// WeightsOptions::matrix_dtype (FP8 with one F32 scale per 128 x 128 block); the vocabulary heads
// at HeadMatrixDType; kv_b (split into the MLA absorption matrices) at AbsorbedMatrixDType; the
// embedding, the router and the rest at F32.
uint64_t StoredBytes(absl::string_view name, const model::TensorView& view, kernels::DType matrix_dtype) {
  const uint64_t n = view.numel();
  if (view.shape.size() != 2 || absl::StrContains(name, "embed_tokens") || absl::EndsWith(name, "mlp.gate.weight")) {
    return n * sizeof(float);
  }
  if (absl::StrContains(name, "kv_b_proj")) return n * kernels::DTypeSize(model::AbsorbedMatrixDType(matrix_dtype));
  if (absl::StartsWith(name, "lm_head.") || absl::StrContains(name, "shared_head.head.")) {
    return n * kernels::DTypeSize(model::HeadMatrixDType(matrix_dtype));
  }
  uint64_t bytes = n * kernels::DTypeSize(matrix_dtype);
  if (matrix_dtype == kernels::DType::kF8E4M3) {
    bytes += static_cast<uint64_t>(kernels::WeightScaleBlocks(view.shape[0]) * kernels::WeightScaleBlocks(view.shape[1])) *
             sizeof(float);
  }
  return bytes;
}

}  // namespace

std::string DeviceBytesEstimate::ToString() const {
  return absl::StrCat(GiB(total()), " (dense weights ", GiB(dense_weights), ", routed experts ", GiB(routed_experts),
                      ", KV cache ", GiB(kv_cache), ", slot arena ", GiB(slot_arena), ", workspace ",
                      GiB(workspace), ")");
}

absl::StatusOr<DeviceBytesEstimate> EstimateDeviceBytes(const DeviceFitInputs& in) {
  if (in.checkpoint == nullptr || in.config == nullptr) {
    return absl::InvalidArgumentError("device fit: no checkpoint or config");
  }
  const model::ModelConfig& config = *in.config;
  DeviceBytesEstimate estimate{.slot_arena = in.slot_arena_bytes, .workspace = kDeviceWorkspaceBytes};
  bool has_mtp_weights = false;
  for (const std::string& name : in.checkpoint->Names()) {
    const int64_t layer = LayerOf(name);
    has_mtp_weights |= layer >= config.num_hidden_layers;
    // NVFP4 routed experts (services/nvfp4/served_experts.h) stay as stored: packed codes (U8) and
    // E4M3 block scales (.weight_scale, kept, unlike an FP8 checkpoint's folded ones).
    if (in.release == nullptr && absl::StrContains(name, ".mlp.experts.")) {
      ASSIGN_OR_RETURN(const model::TensorView view, in.checkpoint->Find(name));
      if (view.dtype == model::DType::kU8 ||
          (absl::EndsWith(name, ".weight_scale") && view.dtype == model::DType::kF8E4M3)) {
        estimate.routed_experts += view.data.size();
        continue;
      }
    }
    if (IsFoldedScale(name)) continue;
    // With a release the decoder layers' routed experts come from it alone.
    if (in.release != nullptr && layer >= 0 && layer < config.num_hidden_layers &&
        absl::StrContains(name, ".mlp.experts.")) {
      continue;
    }
    ASSIGN_OR_RETURN(const model::TensorView view, in.checkpoint->Find(name));
    estimate.dense_weights += StoredBytes(name, view, in.weight_dtype);
  }
  if (in.release != nullptr) {
    for (const format::RankIndex& index : in.release->indexes()) {
      if (index.rank != in.rank) continue;
      for (const format::LayerEntry& layer : index.layers) estimate.routed_experts += layer.resident.bytes;
    }
  }
  std::vector<bool> cache_layers = model::KvCacheIndexerLayers(config);
  if (!has_mtp_weights) cache_layers.resize(static_cast<size_t>(config.num_hidden_layers));
  estimate.kv_cache =
      static_cast<uint64_t>(model::KvCache::BytesFor(config, cache_layers, in.max_tokens, in.kv_cache_dtype));
  return estimate;
}

absl::Status CheckFitsOnDevice(const DeviceBytesEstimate& needed, uint64_t free_bytes, uint64_t total_bytes,
                               const std::string& device) {
  if (needed.total() <= free_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the model does not fit on ", device, ": it needs about ", needed.ToString(), ", the device has ",
      GiB(free_bytes), " free of ", GiB(total_bytes),
      "; shorten --max_model_len, use --kv_cache_dtype bf16, or free the "
      "device"));
}

}  // namespace nq::worker
