// Whether a model fits on the GPU a CUDA worker was given, checked before anything is loaded:
// a worker that would run out of device memory halfway through loading (minutes into a large
// checkpoint) instead refuses at once, naming what it needs and what the device has free.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "services/format/release_reader.h"
#include "services/model/model_config.h"
#include "services/model/safetensors.h"

namespace nq::worker {

// Device bytes a worker will hold, by what holds them.
struct DeviceBytesEstimate {
  uint64_t dense_weights = 0;   // every checkpoint tensor the model loads: matrices at weight_dtype, the rest F32
  uint64_t routed_experts = 0;  // the release's resident files (2-bit bases, scales, tables)
  uint64_t kv_cache = 0;
  uint64_t slot_arena = 0;
  uint64_t workspace = 0;  // activations, scratch, the CUDA context's own use: a fixed allowance

  uint64_t total() const { return dense_weights + routed_experts + kv_cache + slot_arena + workspace; }
  std::string ToString() const;  // "12.3 GiB (dense weights 8.1 GiB, routed experts ...)"
};

struct DeviceFitInputs {
  const model::Checkpoint* checkpoint = nullptr;
  const model::ModelConfig* config = nullptr;
  // The served release (routed experts come from it and not from the checkpoint), or null.
  const format::Release* release = nullptr;
  uint32_t rank = 0;
  int64_t max_tokens = 0;
  kernels::DType kv_cache_dtype = kernels::DType::kF32;
  kernels::DType weight_dtype = kernels::DType::kF32;  // of the weight matrices (WeightsOptions)
  uint64_t slot_arena_bytes = 0;
};

// The allowance for activations, scratch and the CUDA context.
inline constexpr uint64_t kDeviceWorkspaceBytes = uint64_t{1} << 30;

absl::StatusOr<DeviceBytesEstimate> EstimateDeviceBytes(const DeviceFitInputs& inputs);

// OK when `needed` fits in `free_bytes`; else RESOURCE_EXHAUSTED naming the device, the bytes
// needed (by part) and the bytes free, and what to change.
absl::Status CheckFitsOnDevice(const DeviceBytesEstimate& needed, uint64_t free_bytes, uint64_t total_bytes,
                               const std::string& device);

}  // namespace nq::worker
