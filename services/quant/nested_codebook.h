// The nested 2-bit / 4-bit scalar codebook for rotated, near-N(0,1) weights.
//
// Four base levels c_b (2 bits) and, inside each base cell b, four residual offsets d_{b,r}
// (2 more bits): the 4-bit value is c_b + d_{b,r}. The codebook minimises, for x ~ N(0,1),
//   lambda * E[(x - c_b)^2] + (1 - lambda) * E[(x - c_b - d_{b,r})^2]
// over the joint choice of (b, r). It is derived numerically (DesignNestedCodebook) by a
// Lloyd iteration on a fine grid of the Gaussian density: the assignment step picks the
// (b, r) minimising the blended cost, the update step sets c_b to the mean of base cell b
// and c_b + d_{b,r} to the mean of the sub-cell (b, r); each step lowers the objective.
// lambda = 1 gives the 2-bit Lloyd-Max quantiser (MSE 0.1175) with conditional residuals;
// lambda = 0 gives the best 16-level quantiser whose cells nest in groups of four.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"

namespace nq::quant {

inline constexpr int kBaseLevels = 4;      // 2-bit base
inline constexpr int kResidualLevels = 4;  // 2-bit residual per base cell

struct NestedCodebook {
  double lambda = 0.5;
  std::array<float, kBaseLevels> base{};  // ascending
  // residual[b * kResidualLevels + r] = d_{b,r}, offsets from base[b], ascending in r.
  std::array<float, kBaseLevels * kResidualLevels> residual{};

  float Level4(int b, int r) const { return base[b] + residual[b * kResidualLevels + r]; }
};

// Levels snapped to fp16 values: v rounded to nearest (ties to even) at fp16's precision (11
// significant bits, subnormal step 2^-24, saturating at 65504). The codebooks nq encode writes
// hold only such levels, and each 4-bit level base[b] + residual[b, r] is one too, so the GPU
// kernels, which hold levels as fp16, multiply by exactly the levels the CPU decoder adds up
// (kernels/nq_moe.h); the design loses nothing measurable (a level moves by at most 2^-11 of itself).
float RoundToHalfPrecision(float v);
NestedCodebook SnapToHalfGrid(NestedCodebook cb);

// The blended-objective codebook for N(0,1); lambda in [0, 1]. Results are cached per
// lambda (encoding thousands of expert matrices designs it once).
absl::StatusOr<NestedCodebook> DesignNestedCodebook(double lambda);

// The expected distortions of `cb` on N(0,1) when coding with blend `lambda` (grid
// integration): {2-bit MSE, 4-bit MSE}.
std::array<double, 2> GaussianDistortion(const NestedCodebook& cb, double lambda);

// Chooses (b, r) for one weight. `x2` is the value the base is fitted to, `x4` the value the
// 4-bit reconstruction is fitted to (equal without error feedback; they differ under LDLQ,
// where each precision carries its own feedback). Base: argmin_b lambda*(x2 - c_b)^2 +
// (1-lambda)*min_r (x4 - c_b - d_{b,r})^2; residual: argmin_r (x4 - c_b - d_{b,r})^2.
// The base choice never depends on whether the residual is later kept (nested property).
struct NestedChoice {
  uint8_t base;
  uint8_t residual;
};
NestedChoice ChooseNested(const NestedCodebook& cb, double x2, double x4);

}  // namespace nq::quant
