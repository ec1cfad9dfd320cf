// Backend::Nvfp4Moe: validation of the NVFP4 MoE op's tensors (kernels/nvfp4_moe.h) into the raw
// Nvfp4MoeParams both backends run from, and the default hook for a backend without the op.
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/moe_op_checks.h"
#include "kernels/nvfp4_codes.h"
#include "services/common/status_macros.h"

namespace nq::kernels {
namespace {

constexpr absl::string_view kOp = "Nvfp4Moe";

absl::Status ExpectShape(absl::string_view arg, const Tensor& t, DType dtype, const Shape& shape) {
  return CheckMoeTensor(kOp, arg, t, dtype, shape);
}

Nvfp4ProjectionView View(const Nvfp4Projection& p) {
  return {.packed = p.packed.data_as<std::uint8_t>(),
          .scales = p.scales.data_as<std::uint8_t>(),
          .global_scales = p.global_scales.data_as<float>()};
}

}  // namespace

absl::Status Backend::Nvfp4Moe(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                               const Nvfp4MoeWeights& w, Tensor& out) {
  RETURN_IF_ERROR(RefuseOnSide(kOp));
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "expert_ids", expert_ids));
  RETURN_IF_ERROR(CheckOwned(kOp, "expert_weights", expert_weights));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  const std::int64_t D = w.hidden, I = w.intermediate, E = w.num_experts;
  if (D <= 0 || I <= 0 || E <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": hidden ", D, ", intermediate ", I, " and num_experts ", E, " must be positive"));
  }
  // Rows are whole 16-element blocks along the input dim of both projections.
  if (D % kNvfp4BlockSize != 0 || I % kNvfp4BlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": hidden ", D, " and intermediate ", I,
                                                   " must be multiples of ", kNvfp4BlockSize));
  }
  ASSIGN_OR_RETURN(const MoeTokens tokens, CheckMoeActivations(kOp, x, expert_ids, expert_weights, out, D));
  const std::int64_t T = tokens.tokens, K = tokens.top_k;
  struct Named {
    const char* name;
    const Nvfp4Projection* p;
    std::int64_t rows, cols;
  };
  for (const Named& n : {Named{"gate_up", &w.gate_up, 2 * I, D}, Named{"down", &w.down, D, I}}) {
    RETURN_IF_ERROR(CheckOwned(kOp, absl::StrCat(n.name, ".packed"), n.p->packed));
    RETURN_IF_ERROR(CheckOwned(kOp, absl::StrCat(n.name, ".scales"), n.p->scales));
    RETURN_IF_ERROR(CheckOwned(kOp, absl::StrCat(n.name, ".global_scales"), n.p->global_scales));
    RETURN_IF_ERROR(
        ExpectShape(absl::StrCat(n.name, ".packed"), n.p->packed, DType::kU8, Shape{E, n.rows, n.cols / 2}));
    RETURN_IF_ERROR(ExpectShape(absl::StrCat(n.name, ".scales"), n.p->scales, DType::kF8E4M3,
                                Shape{E, n.rows, n.cols / kNvfp4BlockSize}));
    RETURN_IF_ERROR(ExpectShape(absl::StrCat(n.name, ".global_scales"), n.p->global_scales, DType::kF32, Shape{E}));
  }
  if (T == 0) return absl::OkStatus();
  return DoNvfp4Moe({.tokens = T,
                     .top_k = K,
                     .hidden = D,
                     .intermediate = I,
                     .num_experts = E,
                     .x = x.data_as<float>(),
                     .expert_ids = expert_ids.data_as<std::int32_t>(),
                     .expert_weights = expert_weights.data_as<float>(),
                     .out = out.data_as<float>(),
                     .gate_up = View(w.gate_up),
                     .down = View(w.down)});
}

absl::Status Backend::DoNvfp4Moe(const Nvfp4MoeParams&) {
  return absl::UnimplementedError(absl::StrCat(kOp, " is not implemented by the ", std::string(name()), " backend"));
}

}  // namespace nq::kernels
