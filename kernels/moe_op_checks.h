// Argument checks the MoE ops share (Backend::NqMoe, Backend::Nvfp4Moe): the tensors that carry
// tokens and their routing, whatever codes the experts are stored in.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"

namespace nq::kernels {

// InvalidArgument "<op>: <arg> is <t>, want <dtype><shape>" unless t has that dtype and shape.
absl::Status CheckMoeTensor(absl::string_view op, absl::string_view arg, const Tensor& t, DType dtype,
                            const Shape& shape);

struct MoeTokens {
  std::int64_t tokens = 0;  // T
  std::int64_t top_k = 0;   // K
};

// x F32 [T, hidden], expert_ids I32 [T, K] with K >= 1, expert_weights F32 [T, K], out F32
// [T, hidden] not aliasing x. Returns T and K.
absl::StatusOr<MoeTokens> CheckMoeActivations(absl::string_view op, const Tensor& x, const Tensor& expert_ids,
                                              const Tensor& expert_weights, const Tensor& out,
                                              std::int64_t hidden);

}  // namespace nq::kernels
