#include "services/quant/low_rank.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "services/common/status_macros.h"
#include "services/quant/hadamard.h"

namespace nq::quant {
namespace {

// Alternating least-squares sweeps. Each is one step of an orthogonal iteration whose rate is
// (sigma_{r+1} / sigma_r)^2 per sweep; 30 leave the fitted error within 1e-6 of its limit on the
// planted-outlier test matrices and cost 30 * (cols^2 + rows * cols) * r flops, well below LDLQ's
// rows * cols^2.
constexpr int kSweeps = 30;
// Ridge on the r x r normal equations, relative to their trace: keeps a rank-deficient error (an
// all-zero matrix, fewer independent directions than r) solvable without changing a
// well-conditioned solve.
constexpr double kRidge = 1e-12;
constexpr int64_t kHalfBytes = 2;

// Solves A X = B in place for a small symmetric positive semi-definite A (n x n, n <= 4) and B
// (n x m), both row-major; a ridge keeps a singular A solvable. Gaussian elimination with partial
// pivoting.
void SolveSmall(std::vector<double> a, std::vector<double>& b, int n, int64_t m) {
  double trace = 0;
  for (int i = 0; i < n; ++i) trace += a[i * n + i];
  const double ridge = std::max(kRidge * trace, 1e-300);
  for (int i = 0; i < n; ++i) a[i * n + i] += ridge;
  for (int c = 0; c < n; ++c) {
    int pivot = c;
    for (int r = c + 1; r < n; ++r) {
      if (std::abs(a[r * n + c]) > std::abs(a[pivot * n + c])) pivot = r;
    }
    if (pivot != c) {
      for (int k = 0; k < n; ++k) std::swap(a[c * n + k], a[pivot * n + k]);
      for (int64_t k = 0; k < m; ++k) std::swap(b[c * m + k], b[pivot * m + k]);
    }
    const double d = a[c * n + c];
    for (int r = 0; r < n; ++r) {
      if (r == c || a[r * n + c] == 0) continue;
      const double f = a[r * n + c] / d;
      for (int k = 0; k < n; ++k) a[r * n + k] -= f * a[c * n + k];
      for (int64_t k = 0; k < m; ++k) b[r * m + k] -= f * b[c * m + k];
    }
  }
  for (int r = 0; r < n; ++r) {
    const double d = a[r * n + r];
    for (int64_t k = 0; k < m; ++k) b[r * m + k] /= d;
  }
}

// y (cols x r) = H_damped * v^T for v (r x cols); H null is the identity.
std::vector<double> HTimesVt(const Hessian* h, double ridge, const std::vector<double>& v, int64_t cols, int r) {
  std::vector<double> y(static_cast<size_t>(cols * r), 0.0);
  for (int64_t j = 0; j < cols; ++j) {
    for (int k = 0; k < r; ++k) {
      double acc = 0;
      if (h == nullptr) {
        acc = v[k * cols + j];
      } else {
        const double* hj = h->values.data() + j * cols;
        const double* vk = v.data() + k * cols;
        for (int64_t l = 0; l < cols; ++l) acc += hj[l] * vk[l];
        acc += ridge * vk[j];
      }
      y[j * r + k] = acc;
    }
  }
  return y;
}

// A fixed start for V: splitmix64 uniforms in [-1, 1), the same on every platform.
std::vector<double> StartV(int64_t cols, int r) {
  std::vector<double> v(static_cast<size_t>(cols * r));
  uint64_t state = 0x6c6f7772616e6b31ull;  // "lowrank1"
  for (double& x : v) x = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-52 - 1.0;
  return v;
}

}  // namespace

OutlierChannels FindOutlierChannels(const Hessian& h, double threshold) {
  std::vector<double> diag(static_cast<size_t>(h.dim));
  for (int64_t j = 0; j < h.dim; ++j) diag[j] = h.values[j * h.dim + j];
  if (diag.empty()) return {};
  std::vector<double> sorted = diag;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<int64_t>(sorted.size() / 2), sorted.end());
  const double median = sorted[sorted.size() / 2];
  OutlierChannels out;
  if (!(median > 0)) return out;
  for (double d : diag) {
    out.max_ratio = std::max(out.max_ratio, d / median);
    if (d > threshold * median) ++out.count;
  }
  return out;
}

void RoundToHalf(std::vector<float>& values) {
  for (float& x : values) x = kernels::ToFloat(kernels::ToF16(x));
}

absl::StatusOr<LowRankFactors> FitLowRank(std::span<const float> e, int64_t rows, int64_t cols, const Hessian* h,
                                          int rank, double damping) {
  if (rank < 1 || rank > kMaxLowRank) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank correction rank ", rank, " is outside [1, ", kMaxLowRank, "]"));
  }
  if (rows <= 0 || cols <= 0 || static_cast<int64_t>(e.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank fit of ", e.size(), " values as ", rows, " x ", cols));
  }
  if (h != nullptr) RETURN_IF_ERROR(ValidateHessian(*h, cols));
  if (damping < 0) return absl::InvalidArgumentError(absl::StrCat("damping ", damping, " is negative"));
  for (float x : e) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("low-rank fit: the error holds a non-finite value");
  }
  double ridge = 0;
  if (h != nullptr) {
    for (int64_t j = 0; j < cols; ++j) ridge += h->values[j * cols + j];
    ridge = damping * ridge / static_cast<double>(cols);
  }
  const int r = rank;
  std::vector<double> v = StartV(cols, r);
  std::vector<double> u(static_cast<size_t>(rows * r), 0.0);
  for (int sweep = 0; sweep < kSweeps; ++sweep) {
    // U step: U = E (H V^T) (V H V^T)^-1, solved as (V H V^T) U^T = (E H V^T)^T.
    const std::vector<double> hv = HTimesVt(h, ridge, v, cols, r);  // cols x r
    std::vector<double> gram(static_cast<size_t>(r * r), 0.0);
    for (int a = 0; a < r; ++a) {
      for (int b = 0; b < r; ++b) {
        double acc = 0;
        for (int64_t j = 0; j < cols; ++j) acc += v[a * cols + j] * hv[j * r + b];
        gram[a * r + b] = acc;
      }
    }
    std::vector<double> ut(static_cast<size_t>(r * rows), 0.0);  // r x rows
    for (int64_t i = 0; i < rows; ++i) {
      const float* ei = e.data() + i * cols;
      for (int k = 0; k < r; ++k) {
        double acc = 0;
        for (int64_t j = 0; j < cols; ++j) acc += ei[j] * hv[j * r + k];
        ut[k * rows + i] = acc;
      }
    }
    SolveSmall(gram, ut, r, rows);
    for (int64_t i = 0; i < rows; ++i) {
      for (int k = 0; k < r; ++k) u[i * r + k] = ut[k * rows + i];
    }
    // V step: V = (U^T U)^-1 U^T E.
    std::vector<double> utu(static_cast<size_t>(r * r), 0.0);
    for (int a = 0; a < r; ++a) {
      for (int b = 0; b < r; ++b) {
        double acc = 0;
        for (int64_t i = 0; i < rows; ++i) acc += u[i * r + a] * u[i * r + b];
        utu[a * r + b] = acc;
      }
    }
    std::fill(v.begin(), v.end(), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      const float* ei = e.data() + i * cols;
      for (int k = 0; k < r; ++k) {
        const double uik = u[i * r + k];
        double* vk = v.data() + k * cols;
        for (int64_t j = 0; j < cols; ++j) vk[j] += uik * ei[j];
      }
    }
    SolveSmall(utu, v, r, cols);
  }
  // Balance each component (||U[:, k]|| = ||V[k, :]||) so both halves sit in fp16's range.
  LowRankFactors f{.rows = rows, .cols = cols, .rank = r};
  f.u.resize(static_cast<size_t>(rows * r));
  f.v.resize(static_cast<size_t>(r * cols));
  for (int k = 0; k < r; ++k) {
    double nu = 0, nv = 0;
    for (int64_t i = 0; i < rows; ++i) nu += u[i * r + k] * u[i * r + k];
    for (int64_t j = 0; j < cols; ++j) nv += v[k * cols + j] * v[k * cols + j];
    const double s = nu > 0 && nv > 0 ? std::sqrt(std::sqrt(nv / nu)) : 1.0;
    for (int64_t i = 0; i < rows; ++i) f.u[i * r + k] = static_cast<float>(u[i * r + k] * s);
    for (int64_t j = 0; j < cols; ++j) f.v[k * cols + j] = static_cast<float>(v[k * cols + j] / s);
  }
  RoundToHalf(f.u);
  RoundToHalf(f.v);
  return f;
}

double WeightedError(std::span<const float> e, int64_t rows, int64_t cols, const Hessian* h) {
  double total = 0;
  std::vector<double> he(static_cast<size_t>(cols));
  for (int64_t i = 0; i < rows; ++i) {
    const float* ei = e.data() + i * cols;
    if (h == nullptr) {
      for (int64_t j = 0; j < cols; ++j) total += static_cast<double>(ei[j]) * ei[j];
      continue;
    }
    for (int64_t j = 0; j < cols; ++j) {
      const double* hj = h->values.data() + j * cols;
      double acc = 0;
      for (int64_t l = 0; l < cols; ++l) acc += hj[l] * ei[l];
      total += acc * ei[j];
    }
  }
  return total;
}

double WeightedErrorAfter(std::span<const float> e, int64_t rows, int64_t cols, const Hessian* h, double error,
                          std::span<const LowRankFactors* const> factors) {
  // U (rows x r) and V (r x cols) of every pair side by side.
  int r = 0;
  for (const LowRankFactors* f : factors) r += f->rank;
  if (r == 0) return error;
  std::vector<double> u(static_cast<size_t>(rows * r)), v(static_cast<size_t>(r * cols));
  int k0 = 0;
  for (const LowRankFactors* f : factors) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int k = 0; k < f->rank; ++k) u[i * r + k0 + k] = f->u[i * f->rank + k];
    }
    for (int k = 0; k < f->rank; ++k) {
      for (int64_t j = 0; j < cols; ++j) v[(k0 + k) * cols + j] = f->v[k * cols + j];
    }
    k0 += f->rank;
  }
  const std::vector<double> hv = HTimesVt(h, 0.0, v, cols, r);  // cols x r, undamped
  double cross = 0;  // tr(U^T E H V^T)
  for (int64_t i = 0; i < rows; ++i) {
    const float* ei = e.data() + i * cols;
    for (int k = 0; k < r; ++k) {
      double acc = 0;
      for (int64_t j = 0; j < cols; ++j) acc += ei[j] * hv[j * r + k];
      cross += u[i * r + k] * acc;
    }
  }
  double quadratic = 0;  // tr(U^T U V H V^T)
  for (int a = 0; a < r; ++a) {
    for (int b = 0; b < r; ++b) {
      double utu = 0, vhv = 0;
      for (int64_t i = 0; i < rows; ++i) utu += u[i * r + a] * u[i * r + b];
      for (int64_t j = 0; j < cols; ++j) vhv += v[b * cols + j] * hv[j * r + a];
      quadratic += utu * vhv;
    }
  }
  return std::max(0.0, error - 2 * cross + quadratic);
}

namespace {
void AccumulateLowRank(const LowRankFactors& f, std::span<float> w, float sign) {
  for (int64_t i = 0; i < f.rows; ++i) {
    float* wi = w.data() + i * f.cols;
    for (int k = 0; k < f.rank; ++k) {
      const float uik = sign * f.u[i * f.rank + k];
      const float* vk = f.v.data() + k * f.cols;
      for (int64_t j = 0; j < f.cols; ++j) wi[j] += uik * vk[j];
    }
  }
}
}  // namespace

void AddLowRank(const LowRankFactors& f, std::span<float> w) { AccumulateLowRank(f, w, 1.0f); }
void SubtractLowRank(const LowRankFactors& f, std::span<float> e) { AccumulateLowRank(f, e, -1.0f); }

absl::Status ValidateLowRank(const LowRankFactors& f, int64_t rows, int64_t cols, const char* what) {
  if (f.rank < 0 || f.rank > kMaxLowRank) {
    return absl::DataLossError(absl::StrCat(what, ": low-rank correction of rank ", f.rank, ", outside [0, ", kMaxLowRank, "]"));
  }
  if (f.rows != rows || f.cols != cols || static_cast<int64_t>(f.u.size()) != rows * f.rank ||
      static_cast<int64_t>(f.v.size()) != f.rank * cols) {
    return absl::DataLossError(absl::StrCat(what, ": low-rank factors of ", f.u.size(), " and ", f.v.size(),
                                            " values do not fit rank ", f.rank, " of a ", rows, " x ", cols, " matrix"));
  }
  for (const std::vector<float>* part : {&f.u, &f.v}) {
    for (float x : *part) {
      if (!std::isfinite(x)) return absl::DataLossError(absl::StrCat(what, ": low-rank factors hold a non-finite value"));
    }
  }
  return absl::OkStatus();
}

int64_t LowRankBytes(int64_t rows, int64_t cols, int max_rank) { return (rows + cols) * max_rank * kHalfBytes; }

std::vector<uint8_t> PackLowRank(const LowRankFactors& f, int max_rank) {
  std::vector<uint8_t> out(static_cast<size_t>(LowRankBytes(f.rows, f.cols, max_rank)), 0);
  auto put = [&](int64_t index, float x) {
    const uint16_t bits = kernels::ToF16(x).bits;
    out[2 * index] = static_cast<uint8_t>(bits & 0xff);
    out[2 * index + 1] = static_cast<uint8_t>(bits >> 8);
  };
  for (int64_t i = 0; i < f.rows; ++i) {
    for (int k = 0; k < f.rank; ++k) put(i * max_rank + k, f.u[i * f.rank + k]);
  }
  const int64_t v0 = f.rows * max_rank;
  for (int k = 0; k < f.rank; ++k) {
    for (int64_t j = 0; j < f.cols; ++j) put(v0 + k * f.cols + j, f.v[k * f.cols + j]);
  }
  return out;
}

absl::StatusOr<LowRankFactors> UnpackLowRank(std::span<const uint8_t> bytes, int64_t rows, int64_t cols, int rank,
                                             int max_rank) {
  if (max_rank < 1 || max_rank > kMaxLowRank || rank < 0 || rank > max_rank) {
    return absl::DataLossError(absl::StrCat("low-rank factors of rank ", rank, " stored at rank ", max_rank,
                                            " (at most ", kMaxLowRank, ")"));
  }
  if (static_cast<int64_t>(bytes.size()) != LowRankBytes(rows, cols, max_rank)) {
    return absl::DataLossError(absl::StrCat("low-rank factors of a ", rows, " x ", cols, " matrix at rank ", max_rank,
                                            " take ", LowRankBytes(rows, cols, max_rank), " bytes, got ", bytes.size(),
                                            " (truncated or of another layout)"));
  }
  auto get = [&](int64_t index) {
    return kernels::ToFloat(kernels::F16{static_cast<uint16_t>(bytes[2 * index] | bytes[2 * index + 1] << 8)});
  };
  LowRankFactors f{.rows = rows, .cols = cols, .rank = rank};
  f.u.resize(static_cast<size_t>(rows * rank));
  f.v.resize(static_cast<size_t>(rank * cols));
  const int64_t v0 = rows * max_rank;
  for (int64_t i = 0; i < rows; ++i) {
    for (int k = 0; k < max_rank; ++k) {
      const float x = get(i * max_rank + k);
      if (k < rank) {
        f.u[i * rank + k] = x;
      } else if (x != 0.0f) {
        return absl::DataLossError(absl::StrCat("low-rank factors: U[", i, "][", k, "] is ", x,
                                                " past the expert's rank ", rank, " (damaged or another expert's)"));
      }
    }
  }
  for (int k = 0; k < max_rank; ++k) {
    for (int64_t j = 0; j < cols; ++j) {
      const float x = get(v0 + k * cols + j);
      if (k < rank) {
        f.v[k * cols + j] = x;
      } else if (x != 0.0f) {
        return absl::DataLossError(absl::StrCat("low-rank factors: V[", k, "][", j, "] is ", x,
                                                " past the expert's rank ", rank, " (damaged or another expert's)"));
      }
    }
  }
  RETURN_IF_ERROR(ValidateLowRank(f, rows, cols, "low-rank factors"));
  return f;
}

}  // namespace nq::quant
