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

// Both loops below are dot products whose terms must be added in order (the codes depend on these
// values bit for bit, wherever they are encoded); a single chain of them waits on each subtraction.
// So four independent rows (Cholesky) or columns (the inverse) run in lockstep: four chains, each
// element's sum in its own order, the same bits as one at a time (ldlq_test.cc checks them against
// the loops written plainly).
constexpr int64_t kChains = 4;

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
    int64_t i = j + 1;
    for (; i + kChains <= dim; i += kChains) {
      double* r0 = a.data() + i * dim;
      double* r1 = r0 + dim;
      double* r2 = r1 + dim;
      double* r3 = r2 + dim;
      double s0 = r0[j], s1 = r1[j], s2 = r2[j], s3 = r3[j];
      for (int64_t k = 0; k < j; ++k) {
        const double x = aj[k];
        s0 -= r0[k] * x;
        s1 -= r1[k] * x;
        s2 -= r2[k] * x;
        s3 -= r3[k] * x;
      }
      r0[j] = s0 / ljj;
      r1[j] = s1 / ljj;
      r2[j] = s2 / ljj;
      r3[j] = s3 / ljj;
    }
    for (; i < dim; ++i) {
      double* ai = a.data() + i * dim;
      double s = ai[j];
      for (int64_t k = 0; k < j; ++k) s -= ai[k] * aj[k];
      ai[j] = s / ljj;
    }
    for (int64_t k = j + 1; k < dim; ++k) aj[k] = 0.0;
  }
  return absl::OkStatus();
}

namespace {

// L^-1 of a lower triangular n x n matrix r (row-major, positive diagonal), stored transposed:
// linv_t[c][i] = L^-1[i][c], so each column's forward substitution reads it contiguously. Column c
// is col[i] = -(sum over k in [c, i) of r[i][k] col[k]) / r[i][i], col[c] = 1 / r[c][c]. Four
// columns c..c+3 run in lockstep from row c + 4 on, each sum over k from c: a column's entries
// above its diagonal are zero, and adding r[i][k] * 0 to a sum that is still +0 leaves +0, so every
// sum sees the terms of its own column's loop, in the same order.
std::vector<double> InverseTransposed(const std::vector<double>& r, int64_t n) {
  std::vector<double> linv_t(static_cast<size_t>(n * n), 0.0);
  auto column_rows = [&](int64_t c, int64_t i_begin, int64_t i_end) {
    double* col = linv_t.data() + c * n;
    for (int64_t i = i_begin; i < i_end; ++i) {
      const double* ri = r.data() + i * n;
      double s = 0.0;
      for (int64_t k = c; k < i; ++k) s += ri[k] * col[k];
      col[i] = -s / ri[i];
    }
  };
  int64_t c = 0;
  for (; c + kChains <= n; c += kChains) {
    // The triangle above row c + 4, column by column; then the four columns together.
    for (int64_t m = 0; m < kChains; ++m) {
      linv_t[(c + m) * n + c + m] = 1.0 / r[(c + m) * n + c + m];
      column_rows(c + m, c + m + 1, c + kChains);
    }
    double* c0 = linv_t.data() + c * n;
    double* c1 = c0 + n;
    double* c2 = c1 + n;
    double* c3 = c2 + n;
    for (int64_t i = c + kChains; i < n; ++i) {
      const double* ri = r.data() + i * n;
      double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
      for (int64_t k = c; k < i; ++k) {
        const double x = ri[k];
        s0 += x * c0[k];
        s1 += x * c1[k];
        s2 += x * c2[k];
        s3 += x * c3[k];
      }
      c0[i] = -s0 / ri[i];
      c1[i] = -s1 / ri[i];
      c2[i] = -s2 / ri[i];
      c3[i] = -s3 / ri[i];
    }
  }
  for (; c < n; ++c) {
    linv_t[c * n + c] = 1.0 / r[c * n + c];
    column_rows(c, c + 1, n);
  }
  return linv_t;
}

}  // namespace

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
  const std::vector<double> linv_t = InverseTransposed(r, n);
  // U[i][j] = L^-1[n-1-i][n-1-j] = linv_t[n-1-j][n-1-i], zero below the diagonal.
  std::vector<double> u(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) u[i * n + j] = linv_t[(n - 1 - j) * n + (n - 1 - i)];
  }
  return u;
}

}  // namespace nq::quant
