#include "services/quant/ldlq.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::quant {

absl::StatusOr<Hessian> HessianFromActivations(std::span<const float> x, int64_t samples,
                                               int64_t dim) {
  if (samples <= 0 || dim <= 0 || static_cast<int64_t>(x.size()) != samples * dim) {
    return absl::InvalidArgumentError(absl::StrCat("activations hold ", x.size(),
                                                   " values, expected ", samples, " x ", dim));
  }
  Hessian h;
  h.dim = dim;
  h.values.assign(static_cast<size_t>(dim * dim), 0.0);
  // Accumulate the upper triangle row by row of X (cache-friendly), then mirror.
  for (int64_t s = 0; s < samples; ++s) {
    const float* row = x.data() + s * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const double xi = row[i];
      if (xi == 0.0) continue;
      double* hrow = h.values.data() + i * dim;
      for (int64_t j = i; j < dim; ++j) hrow[j] += xi * row[j];
    }
  }
  const double inv_n = 1.0 / static_cast<double>(samples);
  for (int64_t i = 0; i < dim; ++i) {
    for (int64_t j = i; j < dim; ++j) {
      h.values[i * dim + j] *= inv_n;
      h.values[j * dim + i] = h.values[i * dim + j];
    }
  }
  return h;
}

absl::Status ValidateHessian(const Hessian& h, int64_t dim) {
  if (h.dim != dim || static_cast<int64_t>(h.values.size()) != dim * dim) {
    return absl::InvalidArgumentError(absl::StrCat("Hessian is ", h.dim, " x ", h.dim, " with ",
                                                   h.values.size(), " values, expected ", dim,
                                                   " x ", dim, " (the matrix's cols)"));
  }
  double max_abs = 0.0;
  for (double v : h.values) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError("Hessian has a non-finite entry");
    max_abs = std::max(max_abs, std::abs(v));
  }
  const double tol = 1e-6 * max_abs;
  for (int64_t i = 0; i < dim; ++i) {
    for (int64_t j = i + 1; j < dim; ++j) {
      if (std::abs(h.values[i * dim + j] - h.values[j * dim + i]) > tol) {
        return absl::InvalidArgumentError(
            absl::StrCat("Hessian is not symmetric at (", i, ", ", j, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CholeskyInPlace(std::span<double> a, int64_t dim) {
  for (int64_t j = 0; j < dim; ++j) {
    double* aj = a.data() + j * dim;
    double d = aj[j];
    for (int64_t k = 0; k < j; ++k) d -= aj[k] * aj[k];
    if (!(d > 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix is not positive definite (pivot ", j, " is ", d, ")"));
    }
    const double ljj = std::sqrt(d);
    aj[j] = ljj;
    for (int64_t i = j + 1; i < dim; ++i) {
      double* ai = a.data() + i * dim;
      double s = ai[j];
      for (int64_t k = 0; k < j; ++k) s -= ai[k] * aj[k];
      ai[j] = s / ljj;
    }
    for (int64_t k = j + 1; k < dim; ++k) aj[k] = 0.0;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> FeedbackFactor(const Hessian& h, double damping) {
  if (!(damping >= 0.0) || !std::isfinite(damping)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hessian damping must be finite and >= 0, got ", damping));
  }
  RETURN_IF_ERROR(ValidateHessian(h, h.dim));
  const int64_t n = h.dim;
  std::vector<double> a = h.values;
  double mean_diag = 0.0;
  for (int64_t i = 0; i < n; ++i) mean_diag += a[i * n + i];
  mean_diag /= static_cast<double>(n);
  if (!(mean_diag > 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Hessian is not positive definite: mean diagonal is ", mean_diag));
  }
  for (int64_t i = 0; i < n; ++i) a[i * n + i] += damping * mean_diag;
  // With J the reversal permutation, Cholesky of J H J = L L^T gives H = V V^T for the
  // upper triangular V = J L J, so H^-1 = V^-T V^-1 and U = V^-1 = J L^-1 J is the upper
  // factor we need (unique, as the diagonal is positive): one factorisation and one
  // triangular inverse instead of inverting H and factorising the inverse.
  std::vector<double> r(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) r[i * n + j] = a[(n - 1 - i) * n + (n - 1 - j)];
  }
  if (absl::Status s = CholeskyInPlace(r, n); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hessian is not positive definite after damping ", damping,
                     " (raise EncodeOptions::damping or add calibration samples): ",
                     s.message()));
  }
  // L^-1 by forward substitution, one column c at a time, stored transposed
  // (linv_t[c][i] = L^-1[i][c]) so the inner loop is contiguous.
  std::vector<double> linv_t(static_cast<size_t>(n * n), 0.0);
  for (int64_t c = 0; c < n; ++c) {
    double* col = linv_t.data() + c * n;
    col[c] = 1.0 / r[c * n + c];
    for (int64_t i = c + 1; i < n; ++i) {
      const double* ri = r.data() + i * n;
      double s = 0.0;
      for (int64_t k = c; k < i; ++k) s += ri[k] * col[k];
      col[i] = -s / ri[i];
    }
  }
  // U[i][j] = L^-1[n-1-i][n-1-j] = linv_t[n-1-j][n-1-i], zero below the diagonal.
  std::vector<double> u(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) u[i * n + j] = linv_t[(n - 1 - j) * n + (n - 1 - i)];
  }
  return u;
}

}  // namespace nq::quant
