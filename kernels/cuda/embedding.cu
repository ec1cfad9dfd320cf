#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/embedding.cuh"

namespace nq::kernels::cuda {

absl::Status LaunchEmbedding(const EmbeddingParams& p, const LaunchContext& ctx) {
  if (p.tokens < 0 || p.tokens > kMaxGridX || p.dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Embedding: unsupported size tokens=", p.tokens, " dim=", p.dim));
  }
  if (!IsFloatDType(p.table_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Embedding: no CUDA kernel for a table of dtype ", DTypeName(p.table_dtype)));
  }
  if (p.tokens == 0 || p.dim == 0) return absl::OkStatus();
  const dim3 grid(static_cast<unsigned>(p.tokens));
  return VisitFloatDType(p.table_dtype, [&](auto tag) {
    RETURN_IF_ERROR(
        LaunchProgrammaticDependent(EmbeddingKernel<decltype(tag)>, grid, dim3(kEmbeddingThreads), 0, ctx, p));
    return CheckLaunch("EmbeddingKernel");
  });
}

}  // namespace nq::kernels::cuda
