// Low-rank corrections of a codec's error (issue #16): on an expert matrix whose calibration
// inputs show outlier channels, a rank-r (r <= kMaxLowRank) pair U V fitted to the quantisation
// error in the metric LDLQ uses, ||X (E - U V)^T||^2 = tr((E - U V) H (E - U V)^T), H = X^T X / n.
//
// Nested like the planes: the base level's factors are fitted to the 2-bit error and live in the
// resident file; the residual level's factors are fitted to the 4-bit error that remains after the
// base factors and travel in the expert's record, so a READY slot applies both:
//   W_2 = W_hat2 + U_b V_b          W_4 = W_hat4 + U_b V_b + U_r V_r
//
// Domain: the factors live in the rotated domain W' = R_rows W R_cols^T, where the codecs code and
// where the packed MoE op already holds both the rotated input (R_in x) and the rotated output
// (before R_rows^T): the correction there costs r dot products of length cols and r axpys of
// length rows per GEMV and no rotation of its own. In the original domain the GEMV would have to
// rotate U and V or the activations back. The dense decoder adds U V to W' and unrotates the sum.
// The fit's metric is rotation-invariant (tr(E H E^T) = tr(E' H' E'^T) with H' = R H R^T), so it is
// done on the rotated error with the rotated Hessian. Outliers are found on the original Hessian's
// diagonal: the rotation exists to spread them, so after it they no longer stand out.
//
// Factors are stored as IEEE fp16 (kernels/dtype.h's ToF16): FitLowRank returns them already
// rounded, so what an encoder measures and writes is what a decoder reads back.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/quant/ldlq.h"

namespace nq::quant {

// The seed system's limit, and ours: rank 4 already captures a handful of outlier channels, and
// each rank costs (rows + cols) fp16 values per level.
inline constexpr int kMaxLowRank = 4;

// U (rows x rank) and V (rank x cols), row-major, in the rotated domain; rank 0 = no correction.
struct LowRankFactors {
  int64_t rows = 0;
  int64_t cols = 0;
  int rank = 0;
  std::vector<float> u;
  std::vector<float> v;

  bool empty() const { return rank == 0; }
  bool operator==(const LowRankFactors&) const = default;
};

// Both levels' factors of one matrix. `residual` is empty exactly when `base` is.
struct LowRankCorrection {
  LowRankFactors base;      // fitted to the 2-bit error: resident
  LowRankFactors residual;  // fitted to the 4-bit error left after `base`: in the record
  bool empty() const { return base.empty(); }
};

// Outlier input channels of a Hessian: diagonal entries above `threshold` times the median
// diagonal (the channels whose inputs carry most of the output error, LLM.int8's outliers).
struct OutlierChannels {
  int64_t count = 0;
  double max_ratio = 0;  // largest diag / median (0 for a zero median)
};
OutlierChannels FindOutlierChannels(const Hessian& h, double threshold);

// Fits factors of rank `rank` (1..kMaxLowRank) minimising tr((E - U V) H (E - U V)^T) for the
// rows x cols error e (row-major); h (cols x cols) null means the identity. H is damped as LDLQ
// damps it (damping * mean diag). Alternating least squares from a fixed start (deterministic
// bytes): the V step is V = (U^T U)^-1 U^T E (H cancels), the U step U = E H V^T (V H V^T)^-1;
// together an orthogonal iteration on E L (H = L L^T) that converges to the weighted top-r
// subspace. The factors come back balanced per component and rounded to fp16.
// InvalidArgument for a bad rank, sizes or a non-finite value.
absl::StatusOr<LowRankFactors> FitLowRank(std::span<const float> e, int64_t rows, int64_t cols, const Hessian* h,
                                          int rank, double damping);

// tr(E H E^T) (h null: ||E||^2), in double: a rows x cols^2 product.
double WeightedError(std::span<const float> e, int64_t rows, int64_t cols, const Hessian* h);
// tr((E - C) H (E - C)^T) for C the sum of `factors`, given `error` = WeightedError(e, ...):
//   error - 2 tr(U^T E H V^T) + tr(U^T U V H V^T)   (U, V the factors side by side),
// a (rows + cols) * cols * r product instead of rows * cols^2. Clamped at 0 against rounding.
double WeightedErrorAfter(std::span<const float> e, int64_t rows, int64_t cols, const Hessian* h, double error,
                          std::span<const LowRankFactors* const> factors);

// w += U V for row-major w (rows x cols); empty factors add nothing. CHECK-free: sizes are the
// caller's contract (ValidateLowRank).
void AddLowRank(const LowRankFactors& f, std::span<float> w);
// e -= U V.
void SubtractLowRank(const LowRankFactors& f, std::span<float> e);

// Rank in [0, kMaxLowRank], u and v of rows x rank and rank x cols for the given shape, every
// value finite. DataLoss naming `what` otherwise (factors come from files).
absl::Status ValidateLowRank(const LowRankFactors& f, int64_t rows, int64_t cols, const char* what);

// ---- Storage: fp16 little-endian, U then V, each padded to `max_rank` --------------------
// Bytes of one level's factors of a rows x cols matrix stored at max_rank.
int64_t LowRankBytes(int64_t rows, int64_t cols, int max_rank);
// U as rows x max_rank, then V as max_rank x cols, components past f.rank zero.
std::vector<uint8_t> PackLowRank(const LowRankFactors& f, int max_rank);
// The inverse of PackLowRank for a correction of `rank` (the resident file says which rank the
// expert has). DataLoss for a size other than LowRankBytes, a non-zero padding component (a
// record that does not belong to this expert or was damaged) or a non-finite value.
absl::StatusOr<LowRankFactors> UnpackLowRank(std::span<const uint8_t> bytes, int64_t rows, int64_t cols, int rank,
                                             int max_rank);

// Rounds every value to the nearest fp16, as stored.
void RoundToHalf(std::vector<float>& values);

}  // namespace nq::quant
