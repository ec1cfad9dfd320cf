// Codec measurements for `nq bench-codec` (issue #5): distortion on i.i.d. N(0,1) beside
// the rate-distortion bound and scalar Lloyd-Max, and relative output error
// ||X (W - W_hat)^T|| / ||X W^T|| against round-to-nearest at the same bits.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/quant/codec.h"

namespace nq::quant {

// D(R) = 2^(-2R) for a unit Gaussian source (Shannon): the bound at 2 and 4 bits.
inline constexpr double kRateDistortion2Bit = 0.0625;
inline constexpr double kRateDistortion4Bit = 0.00390625;
// Scalar Lloyd-Max quantiser MSE for N(0,1) at 4 and 16 levels (Max 1960).
inline constexpr double kLloydMax2Bit = 0.1175;
inline constexpr double kLloydMax4Bit = 0.0095;

// Deterministic i.i.d. N(0,1) values (splitmix64 + Box-Muller), identical on every platform
// up to libm's log/sin/cos rounding.
std::vector<float> GaussianValues(int64_t count, uint64_t seed);

// Round-to-nearest baseline at `bits` (2 or 4) with the codec's scale granularity but no
// rotation, codebook or feedback: per row, scale = RMS of the row, and a uniform symmetric
// grid of 2^bits levels whose step is the MSE-optimal uniform step for N(0,1) (0.9957 at 4
// levels, 0.3352 at 16; Max 1960), round to nearest.
absl::StatusOr<std::vector<float>> RoundToNearest(std::span<const float> w, int64_t rows,
                                                  int64_t cols, int bits);

struct GaussianMseReport {
  int64_t n = 0;
  double mse_2bit = 0.0;  // the codec, decoded at 2 bits
  double mse_4bit = 0.0;  // the codec, decoded at 4 bits
  double rtn_mse_2bit = 0.0;
  double rtn_mse_4bit = 0.0;
};

// Encodes i.i.d. N(0,1) n x n (identity Hessian) with `codec_name` and measures the MSE at
// both precisions, and the RTN baseline's. n must suit the rotation blocks in `options`.
absl::StatusOr<GaussianMseReport> MeasureGaussianMse(int64_t n, uint64_t seed,
                                                     absl::string_view codec_name = "nested_scalar_v1",
                                                     const EncodeOptions& options = {});

// Correlated activations for the output-error measurement: samples x dim, each row an AR(1)
// sequence across features (correlation `rho`) times a per-feature log-normal scale, so the
// Hessian is far from the identity, as real layer inputs are.
std::vector<float> CorrelatedActivations(int64_t samples, int64_t dim, double rho,
                                         uint64_t seed);

// The AR(1) Hessian h_ij = rho^|i - j| (dim x dim): the LDLQ encode-time benchmarks' Hessian
// (trellis_search_bench, ldlq_host_bench).
Hessian Ar1Hessian(int64_t dim, double rho);

// ||X E^T||_F / ||X W^T||_F computed through H = X^T X / n: sqrt(tr(E H E^T) / tr(W H W^T)).
absl::StatusOr<double> RelativeOutputError(std::span<const float> w,
                                           std::span<const float> w_hat, int64_t rows,
                                           int64_t cols, const Hessian& h);

struct OutputErrorReport {
  // Relative output error of the codec without a Hessian (plain rounding) ...
  double plain_2bit = 0.0;
  double plain_4bit = 0.0;
  // ... with the calibration Hessian (LDLQ) ...
  double ldlq_2bit = 0.0;
  double ldlq_4bit = 0.0;
  // ... and of RoundToNearest.
  double rtn_2bit = 0.0;
  double rtn_4bit = 0.0;
};

// W i.i.d. N(0,1) rows x cols, X = CorrelatedActivations(samples, cols, rho), H = X^T X / n.
absl::StatusOr<OutputErrorReport> MeasureOutputError(
    int64_t rows, int64_t cols, int64_t samples, double rho, uint64_t seed,
    absl::string_view codec_name = "nested_scalar_v1", const EncodeOptions& options = {});

// Bits per weight of an encoded rows x cols matrix, every side table counted: the planes,
// fp32 row/column scales, fp32 codebooks (gains) and the rotation record (4 x int64), as
// nq encode's resident file and record hold them. `at_4bit` adds the residual plane.
double BitsPerWeight(const EncodedMatrix& m, bool at_4bit);

// Wall seconds to encode a whole rows x cols N(0,1) matrix (identity Hessian) with trellis_v1's
// tiles searched by `search` (the GPU's, for `nq bench-codec --device cuda`).
absl::StatusOr<double> MeasureSearchedEncodeSeconds(int64_t rows, int64_t cols, TrellisTileSearch& search,
                                                    uint64_t seed);

struct EncodeCostReport {
  int64_t rows = 0;        // the matrix the figures are for (e.g. 7168 x 2048)
  int64_t cols = 0;
  int64_t slice_rows = 0;  // rows actually encoded and timed
  double slice_seconds = 0.0;
  // slice_seconds * rows / slice_rows: every codec here costs the same per row of tiles.
  double seconds_per_matrix = 0.0;
  double bits_2bit = 0.0;  // BitsPerWeight at rows x cols
  double bits_4bit = 0.0;
};

// Times (thread CPU time) one single-threaded CPU encode (identity Hessian) of a slice_rows x cols slice of
// i.i.d. N(0,1) and extrapolates to rows x cols; the bits per weight are those of the full
// shape. slice_rows must divide rows and suit the row rotation block (128 or less).
absl::StatusOr<EncodeCostReport> MeasureEncodeCost(absl::string_view codec_name, int64_t rows,
                                                   int64_t cols, int64_t slice_rows, uint64_t seed);

}  // namespace nq::quant
