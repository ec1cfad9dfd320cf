// LDLQ / GPTQ-style error feedback (Frantar et al. 2022; Chee et al. 2023, QuIP's LDLQ is
// the same rounding): quantise column by column and push each column's scaled error onto
// the columns not yet quantised, so the output error ||X (W - W_hat)^T|| for the calibration
// activations X (Hessian H = X^T X / n) shrinks.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::quant {

// A proxy Hessian of one linear layer's input: H = X^T X / n, dim x dim, row-major,
// symmetric positive semi-definite. dim equals the weight matrix's cols.
struct Hessian {
  int64_t dim = 0;
  std::vector<double> values;
};

// H = X^T X / samples for activations x (samples x dim, row-major).
absl::StatusOr<Hessian> HessianFromActivations(std::span<const float> x, int64_t samples,
                                               int64_t dim);

// Checks that `h` is dim x dim, finite and symmetric (to a relative 1e-6).
absl::Status ValidateHessian(const Hessian& h, int64_t dim);

// The feedback factor: the upper Cholesky factor U of (H + damping * mean(diag H) * I)^-1,
// i.e. (H_damped)^-1 = U^T U (row-major, dim x dim, zero below the diagonal). Quantising
// column j with error e_j, the feedback is x[:, k] -= e_j / U[j][j] * U[j][k] for k > j.
// `damping` (>= 0) is relative to the mean diagonal, as in GPTQ (default 0.01). Errors:
// InvalidArgument for a negative damping or a Hessian that is not positive definite after
// damping.
absl::StatusOr<std::vector<double>> FeedbackFactor(const Hessian& h, double damping);

// In-place lower Cholesky factorisation A = L L^T of a dim x dim row-major matrix; on
// success the lower triangle holds L and the strict upper triangle is zeroed. Fails with
// InvalidArgument naming the first non-positive pivot.
absl::Status CholeskyInPlace(std::span<double> a, int64_t dim);

}  // namespace nq::quant
