// A CUDA device's memory as the driver reports it (cudaMemGetInfo): for a CUDA worker's
// device-fit check before loading and its /metrics gauges.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace nq::worker {

struct GpuMemory {
  uint64_t free = 0;
  uint64_t total = 0;
};

// UNIMPLEMENTED in a build without CUDA; the CUDA error otherwise.
absl::StatusOr<GpuMemory> QueryGpuMemory(int gpu);

}  // namespace nq::worker
