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
//
// Base grids. kLloyd lets the four base levels move freely (the design above). kUniform holds
// them on an even grid s * (b - 1.5), fitting only the step s, while the 16 4-bit levels stay
// free: for N(0,1) at lambda = 0.5 the 2-bit MSE rises by 1.2 % (0.11750 -> 0.11887) and the
// 4-bit MSE falls slightly (0.00970 -> 0.00965, the residuals absorb the base's move). The GPU
// decodes an even grid with two instructions per weight pair (a lop3 that makes the
// fp16 1024 + code * 4^j and one half2 fused multiply-add) instead of byte-permute lookups, which
// is what the 2-bit decode GEMV is bound by (kernels/cuda/nq_code_lookup.cuh). The step keeps
// 9 significant bits, so s * 0.5 and s * 1.5 are fp16 values (the levels stay on the fp16 grid
// after SnapToHalfGrid) and the kernel can prove the grid from the stored levels alone.
//
// kUniformNested also puts the sixteen 4-bit levels on the even grid nested in the base's:
// s / 4 * (4 b + r - 7.5), each the base level plus s / 4 * (r - 1.5); only s is fitted (to the
// blended objective). The GPU then decodes 4-bit weights without lookups as well (two lop3 a code
// word pair per eight codes and one per weight pair, against the table decode's prmt chains). The
// step keeps 7 significant bits, so every 4-bit level, s times an odd multiple of 1/8 below 2, is
// an fp16 value. What it costs in MSE on N(0,1) is in nested_codebook_test.cc.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::quant {

inline constexpr int kBaseLevels = 4;      // 2-bit base
inline constexpr int kResidualLevels = 4;  // 2-bit residual per base cell

enum class BaseGrid { kUniform, kLloyd, kUniformNested };

// The names nq encode's --base_levels and the manifest's codec.params.base_grid use: "uniform",
// "lloyd", "uniform_nested". ParseBaseGrid's error reads "must be ..., got 'NAME'" (callers name
// the setting).
absl::string_view BaseGridName(BaseGrid grid);
absl::StatusOr<BaseGrid> ParseBaseGrid(absl::string_view name);

// Significant bits of an even grid's step: the base grid's, and the uniform nested grid's.
inline constexpr int kUniformStepBits = 9;
inline constexpr int kUniformNestedStepBits = 7;

struct NestedCodebook {
  double lambda = 0.5;
  BaseGrid grid = BaseGrid::kUniform;
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

// Base level b of an even grid: step * (b - 1.5).
constexpr double EvenGridLevel(double step, int b) { return step * (b - 0.5 * (kBaseLevels - 1)); }

// 4-bit level (b, r) of uniform nested levels: step / 4 * (4 b + r - 7.5).
constexpr double UniformNestedLevel(double step, int b, int r) {
  return step / kResidualLevels * (b * kResidualLevels + r - 0.5 * (kBaseLevels * kResidualLevels - 1));
}

// The step of an even grid rounded to `bits` significant bits (see BaseGrid); 0 stays 0.
double SnapUniformStep(double step, int bits = kUniformStepBits);

// The least-squares step of an even base grid for cells with target sums base_sum[b] and
// masses base_mass[b] (the Lloyd update of the step: the 4-bit term does not depend on it,
// since the residuals re-centre on whatever base they get), snapped; `fallback` when no mass.
double FitUniformStep(const std::array<double, kBaseLevels>& base_sum,
                      const std::array<double, kBaseLevels>& base_mass, double fallback);

// The least-squares step of uniform nested levels for base cells (sums and masses of the 2-bit
// targets) and sub-cells (of the 4-bit targets) under the blend lambda * (2-bit error) +
// (1 - lambda) * (4-bit error), snapped to kUniformNestedStepBits; `fallback` when no mass.
double FitUniformNestedStep(const std::array<double, kBaseLevels>& base_sum,
                            const std::array<double, kBaseLevels>& base_mass,
                            const std::array<double, kBaseLevels * kResidualLevels>& sub_sum,
                            const std::array<double, kBaseLevels * kResidualLevels>& sub_mass, double lambda,
                            double fallback);

// The codebook of uniform nested levels with step `step` (already snapped).
NestedCodebook UniformNestedCodebook(double lambda, double step);

// The blended-objective codebook for N(0,1); lambda in [0, 1]. Results are cached per
// (lambda, grid) (encoding thousands of expert matrices designs it once).
absl::StatusOr<NestedCodebook> DesignNestedCodebook(double lambda, BaseGrid grid);

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
