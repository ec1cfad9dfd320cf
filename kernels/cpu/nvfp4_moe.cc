#include "kernels/cpu/nvfp4_moe.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/nvfp4_gemv.h"
#include "kernels/nvfp4_codes.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cpu {
namespace {

// Expert e's projection of `rows` x `cols` as the reference GEMV takes it.
Nvfp4GemvParams ExpertGemv(const Nvfp4ProjectionView& w, std::int32_t e, std::int64_t rows, std::int64_t cols) {
  return {.packed = w.packed + static_cast<std::int64_t>(e) * rows * (cols / 2),
          .scales = w.scales + static_cast<std::int64_t>(e) * rows * (cols / kNvfp4BlockSize),
          .global_scale = w.global_scales[e],
          .m = 1,
          .n = rows,
          .k = cols};
}

absl::Status CheckAssignments(const Nvfp4MoeParams& p) {
  for (std::int64_t t = 0; t < p.tokens; ++t) {
    const std::int32_t* ids = p.expert_ids + t * p.top_k;
    for (std::int64_t k = 0; k < p.top_k; ++k) {
      if (ids[k] < 0 || ids[k] >= p.num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("Nvfp4Moe: token ", t, " names expert ", ids[k], " of ", p.num_experts));
      }
      if (std::find(ids, ids + k, ids[k]) != ids + k) {
        return absl::InvalidArgumentError(absl::StrCat("Nvfp4Moe: token ", t, " names expert ", ids[k], " twice"));
      }
      for (const Nvfp4ProjectionView* w : {&p.gate_up, &p.down}) {
        if (!std::isfinite(w->global_scales[ids[k]])) {
          return absl::InvalidArgumentError(
              absl::StrCat("Nvfp4Moe: expert ", ids[k], " has a non-finite global scale"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Nvfp4Moe(const Nvfp4MoeParams& p, int threads) {
  RETURN_IF_ERROR(CheckAssignments(p));
  const std::int64_t D = p.hidden, I = p.intermediate;
  std::vector<float> h(static_cast<std::size_t>(2 * I)), act(static_cast<std::size_t>(I)),
      y(static_cast<std::size_t>(D));
  std::fill(p.out, p.out + p.tokens * D, 0.0f);
  for (std::int64_t t = 0; t < p.tokens; ++t) {
    for (std::int64_t k = 0; k < p.top_k; ++k) {
      const std::int32_t e = p.expert_ids[t * p.top_k + k];
      Nvfp4GemvParams gate_up = ExpertGemv(p.gate_up, e, 2 * I, D);
      gate_up.x = p.x + t * D;
      gate_up.y = h.data();
      RETURN_IF_ERROR(Nvfp4Gemv(gate_up, threads));
      // silu(g) * u exactly as the CPU SiluAndMul computes it (kernels/cpu/activation.cc).
      for (std::int64_t i = 0; i < I; ++i) act[i] = h[i] / (1.0f + std::exp(-h[i])) * h[I + i];
      Nvfp4GemvParams down = ExpertGemv(p.down, e, D, I);
      down.x = act.data();
      down.y = y.data();
      RETURN_IF_ERROR(Nvfp4Gemv(down, threads));
      const float w = p.expert_weights[t * p.top_k + k];
      float* out = p.out + t * D;
      for (std::int64_t d = 0; d < D; ++d) out[d] += w * y[d];
    }
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cpu
