// Embedding: out[t, :] = table[ids[t], :], table rows F32 / BF16 / F16 widened to fp32 as they
// are loaded. One block per token; the ids are on the device (the backend copies host ids into
// scratch; a captured step graph's are a tensor). An id outside [0, vocab) gives a zero row: the
// kernel cannot report it, and must not read outside the table.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/load.cuh"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

struct EmbeddingParams {
  const std::int32_t* ids = nullptr;  // [tokens], device
  std::int64_t vocab = 0;             // rows of table
  const void* table = nullptr;        // [vocab, dim], elements of table_dtype
  DType table_dtype = DType::kF32;
  float* out = nullptr;  // [tokens, dim]
  std::int64_t tokens = 0;
  std::int64_t dim = 0;
};

// Contract: ids validated by Backend; tokens < 2^31 (one block per token), dim >= 0.
// InvalidArgumentError for a non-float table dtype.
absl::Status LaunchEmbedding(const EmbeddingParams& params, const LaunchContext& ctx);

inline constexpr int kEmbeddingThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kEmbeddingThreads)
    EmbeddingKernel(const __grid_constant__ EmbeddingParams p) {
  StartAsProgrammaticDependent();
  const std::int64_t t = blockIdx.x;
  const std::int64_t id = p.ids[t];
  float* out = p.out + t * p.dim;
  if (id < 0 || id >= p.vocab) {
    for (std::int64_t c = threadIdx.x; c < p.dim; c += kEmbeddingThreads) out[c] = 0.0f;
    return;
  }
  const T* row = static_cast<const T*>(p.table) + id * p.dim;
  for (std::int64_t c = threadIdx.x; c < p.dim; c += kEmbeddingThreads) {
    out[c] = LoadFloat(row + c);
  }
}

}  // namespace nq::kernels::cuda
