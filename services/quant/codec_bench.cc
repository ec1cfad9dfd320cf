#include "services/quant/codec_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/quant/trellis_codec.h"

namespace nq::quant {
namespace {

// MSE-optimal uniform quantiser steps for N(0,1) (Max 1960, Table II).
constexpr double kUniformStep4Levels = 0.9957;
constexpr double kUniformStep16Levels = 0.3352;

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double Mse(std::span<const float> a, std::span<const float> b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return s / static_cast<double>(a.size());
}

absl::StatusOr<std::vector<float>> EncodeDecode(const Codec& codec, std::span<const float> w,
                                                int64_t rows, int64_t cols, const Hessian* h,
                                                const EncodeOptions& options,
                                                Precision precision) {
  ASSIGN_OR_RETURN(EncodedMatrix m, codec.Encode(w, rows, cols, h, options));
  std::vector<float> out(w.size());
  RETURN_IF_ERROR(codec.Decode(m, precision, out));
  return out;
}

}  // namespace

std::vector<float> GaussianValues(int64_t count, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(count));
  uint64_t state = seed;
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < count; i += 2) {
    // 53-bit uniforms in (0, 1].
    const double u1 = (static_cast<double>(SplitMix64(state) >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    v[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (i + 1 < count) v[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
  }
  return v;
}

absl::StatusOr<std::vector<float>> RoundToNearest(std::span<const float> w, int64_t rows,
                                                  int64_t cols, int bits) {
  if (bits != 2 && bits != 4) {
    return absl::InvalidArgumentError(absl::StrCat("RTN supports 2 or 4 bits, got ", bits));
  }
  if (rows <= 0 || cols <= 0 || static_cast<int64_t>(w.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("weight buffer holds ", w.size(),
                                                   " values, expected ", rows, " x ", cols));
  }
  const int levels = 1 << bits;
  const double step = bits == 2 ? kUniformStep4Levels : kUniformStep16Levels;
  const double half = (levels - 1) / 2.0;
  std::vector<float> out(w.size());
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = w.data() + i * cols;
    double ss = 0.0;
    for (int64_t j = 0; j < cols; ++j) ss += static_cast<double>(row[j]) * row[j];
    const double scale = std::sqrt(ss / cols) * step;
    for (int64_t j = 0; j < cols; ++j) {
      if (scale == 0.0) {
        out[i * cols + j] = 0.0f;
        continue;
      }
      // Level index k in [0, levels): value (k - half) * scale.
      double k = std::round(row[j] / scale + half);
      k = std::clamp(k, 0.0, static_cast<double>(levels - 1));
      out[i * cols + j] = static_cast<float>((k - half) * scale);
    }
  }
  return out;
}

absl::StatusOr<GaussianMseReport> MeasureGaussianMse(int64_t n, uint64_t seed,
                                                     absl::string_view codec_name,
                                                     const EncodeOptions& options) {
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("n must be positive, got ", n));
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(codec_name));
  const std::vector<float> w = GaussianValues(n * n, seed);
  EncodeOptions opts = options;
  opts.keep_residual = true;
  ASSIGN_OR_RETURN(EncodedMatrix m, codec->Encode(w, n, n, nullptr, opts));
  std::vector<float> out(w.size());
  GaussianMseReport report;
  report.n = n;
  RETURN_IF_ERROR(codec->Decode(m, Precision::k2Bit, out));
  report.mse_2bit = Mse(w, out);
  RETURN_IF_ERROR(codec->Decode(m, Precision::k4Bit, out));
  report.mse_4bit = Mse(w, out);
  ASSIGN_OR_RETURN(out, RoundToNearest(w, n, n, 2));
  report.rtn_mse_2bit = Mse(w, out);
  ASSIGN_OR_RETURN(out, RoundToNearest(w, n, n, 4));
  report.rtn_mse_4bit = Mse(w, out);
  return report;
}

Hessian Ar1Hessian(int64_t dim, double rho) {
  Hessian h{dim, std::vector<double>(static_cast<size_t>(dim * dim))};
  for (int64_t i = 0; i < dim; ++i) {
    for (int64_t j = 0; j < dim; ++j) h.values[i * dim + j] = std::pow(rho, std::abs(static_cast<double>(i - j)));
  }
  return h;
}

std::vector<float> CorrelatedActivations(int64_t samples, int64_t dim, double rho,
                                         uint64_t seed) {
  std::vector<float> x = GaussianValues(samples * dim, seed);
  const std::vector<float> log_scale = GaussianValues(dim, seed ^ 0x5ca1ab1eULL);
  const double innovation = std::sqrt(1.0 - rho * rho);
  for (int64_t s = 0; s < samples; ++s) {
    float* row = x.data() + s * dim;
    double prev = row[0];
    for (int64_t k = 1; k < dim; ++k) {
      prev = rho * prev + innovation * row[k];
      row[k] = static_cast<float>(prev);
    }
    for (int64_t k = 0; k < dim; ++k) row[k] *= std::exp(0.5f * log_scale[k]);
  }
  return x;
}

absl::StatusOr<double> RelativeOutputError(std::span<const float> w,
                                           std::span<const float> w_hat, int64_t rows,
                                           int64_t cols, const Hessian& h) {
  RETURN_IF_ERROR(ValidateHessian(h, cols));
  if (static_cast<int64_t>(w.size()) != rows * cols || w_hat.size() != w.size()) {
    return absl::InvalidArgumentError("weight buffers do not match rows x cols");
  }
  // tr(A H A^T) = sum_i a_i^T H a_i.
  auto quad = [&](auto row_fn) {
    double total = 0.0;
    std::vector<double> a(static_cast<size_t>(cols));
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) a[j] = row_fn(i * cols + j);
      for (int64_t j = 0; j < cols; ++j) {
        const double* hj = h.values.data() + j * cols;
        double s = 0.0;
        for (int64_t k = 0; k < cols; ++k) s += hj[k] * a[k];
        total += a[j] * s;
      }
    }
    return total;
  };
  const double err = quad([&](int64_t k) { return static_cast<double>(w[k]) - w_hat[k]; });
  const double ref = quad([&](int64_t k) { return static_cast<double>(w[k]); });
  if (!(ref > 0.0)) return absl::InvalidArgumentError("||X W^T|| is zero");
  return std::sqrt(std::max(err, 0.0) / ref);
}

absl::StatusOr<OutputErrorReport> MeasureOutputError(int64_t rows, int64_t cols,
                                                     int64_t samples, double rho,
                                                     uint64_t seed, absl::string_view codec_name,
                                                     const EncodeOptions& options) {
  if (!(rho >= 0.0 && rho < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("rho must lie in [0, 1), got ", rho));
  }
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix must be non-empty, got ", rows, " x ", cols));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(codec_name));
  const std::vector<float> w = GaussianValues(rows * cols, seed);
  const std::vector<float> x = CorrelatedActivations(samples, cols, rho, seed + 1);
  ASSIGN_OR_RETURN(const Hessian h, HessianFromActivations(x, samples, cols));

  OutputErrorReport r;
  struct Case {
    const Hessian* h;
    Precision p;
    double* out;
  };
  const Case cases[] = {{nullptr, Precision::k2Bit, &r.plain_2bit},
                        {nullptr, Precision::k4Bit, &r.plain_4bit},
                        {&h, Precision::k2Bit, &r.ldlq_2bit},
                        {&h, Precision::k4Bit, &r.ldlq_4bit}};
  for (const Case& c : cases) {
    ASSIGN_OR_RETURN(std::vector<float> w_hat,
                     EncodeDecode(*codec, w, rows, cols, c.h, options, c.p));
    ASSIGN_OR_RETURN(*c.out, RelativeOutputError(w, w_hat, rows, cols, h));
  }
  ASSIGN_OR_RETURN(std::vector<float> rtn2, RoundToNearest(w, rows, cols, 2));
  ASSIGN_OR_RETURN(r.rtn_2bit, RelativeOutputError(w, rtn2, rows, cols, h));
  ASSIGN_OR_RETURN(std::vector<float> rtn4, RoundToNearest(w, rows, cols, 4));
  ASSIGN_OR_RETURN(r.rtn_4bit, RelativeOutputError(w, rtn4, rows, cols, h));
  return r;
}

double BitsPerWeight(const EncodedMatrix& m, bool at_4bit) {
  // The rotation record: row/col block and row/col sign seed, int64 each (release_encoder.cc).
  constexpr double kRotationBits = 4 * 64;
  const double side = 32.0 * static_cast<double>(m.rows + m.cols + m.params.base_codebook.size() +
                                                 m.params.residual_codebook.size()) +
                      kRotationBits;
  double planes = 8.0 * static_cast<double>(BasePlaneBytes(m));
  if (at_4bit) planes += 8.0 * static_cast<double>(ResidualPlaneBytes(m));
  return (planes + side) / static_cast<double>(m.rows * m.cols);
}

absl::StatusOr<EncodeCostReport> MeasureEncodeCost(absl::string_view codec_name, int64_t rows,
                                                   int64_t cols, int64_t slice_rows, uint64_t seed) {
  if (rows <= 0 || cols <= 0 || slice_rows <= 0 || rows % slice_rows != 0) {
    return absl::InvalidArgumentError(absl::StrCat("slice of ", slice_rows, " rows must divide ", rows,
                                                   " x ", cols));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(codec_name));
  const std::vector<float> w = GaussianValues(slice_rows * cols, seed);
  EncodeOptions options;
  options.rotation.row_block = std::min<int64_t>(slice_rows, kDefaultHadamardBlock);
  // CPU time of this thread, not wall time: the encode is single-threaded, and on a shared
  // machine wall time measures the neighbours.
  const double start = ThreadCpuSeconds();
  ASSIGN_OR_RETURN(EncodedMatrix m, codec->Encode(w, slice_rows, cols, nullptr, options));
  EncodeCostReport r;
  r.slice_seconds = ThreadCpuSeconds() - start;
  r.rows = rows;
  r.cols = cols;
  r.slice_rows = slice_rows;
  r.seconds_per_matrix = r.slice_seconds * static_cast<double>(rows / slice_rows);
  // The full shape's planes and scales; the codebooks depend on cols only (both codecs).
  m.rows = rows;
  r.bits_2bit = BitsPerWeight(m, false);
  r.bits_4bit = BitsPerWeight(m, true);
  return r;
}

absl::StatusOr<double> MeasureSearchedEncodeSeconds(int64_t rows, int64_t cols, TrellisTileSearch& search,
                                                    uint64_t seed) {
  const std::vector<float> w = GaussianValues(rows * cols, seed);
  EncodeOptions options;
  options.trellis_search = &search;
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(const EncodedMatrix m, TrellisCodec().Encode(w, rows, cols, nullptr, options));
  (void)m;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace nq::quant
