#include "services/quant/nested_scalar_codec.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/quant/nested_codebook.h"

namespace nq::quant {
namespace {

constexpr int kCodeBits = 2;
// LDLQ lazy-batch geometry: 128 columns per error block (GPTQ's blocksize) and 512-column
// tiles of the deferred update, so a block's U tile (128 x 512 doubles, 512 KiB) stays in
// L2 while the rows stream past it.
constexpr int64_t kFeedbackBlock = 128;
constexpr int64_t kFeedbackTile = 512;

absl::Status ValidateInput(std::span<const float> w, int64_t rows, int64_t cols,
                           const EncodeOptions& o) {
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix must be non-empty, got ", rows, " x ", cols));
  }
  if (static_cast<int64_t>(w.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("weight buffer holds ", w.size(),
                                                   " values, expected ", rows, " x ", cols));
  }
  RETURN_IF_ERROR(ValidateHadamardBlock(rows, o.rotation.row_block, "rows"));
  RETURN_IF_ERROR(ValidateHadamardBlock(cols, o.rotation.col_block, "cols"));
  if (o.scale_passes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale_passes must be >= 1, got ", o.scale_passes));
  }
  if (o.codebook_refinements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("codebook_refinements must be >= 0, got ", o.codebook_refinements));
  }
  for (float v : w) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError("weights hold a non-finite value");
  }
  return absl::OkStatus();
}

// Alternating RMS normalisation of rows and columns of the rotated matrix.
void FoldScales(const std::vector<float>& wr, int64_t rows, int64_t cols, int passes,
                std::vector<float>& row_scales, std::vector<float>& col_scales) {
  row_scales.assign(static_cast<size_t>(rows), 1.0f);
  col_scales.assign(static_cast<size_t>(cols), 1.0f);
  std::vector<double> acc;
  for (int p = 0; p < passes; ++p) {
    for (int64_t i = 0; i < rows; ++i) {
      double s = 0.0;
      const float* row = wr.data() + i * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const double v = col_scales[j] > 0 ? row[j] / col_scales[j] : 0.0;
        s += v * v;
      }
      row_scales[i] = static_cast<float>(std::sqrt(s / cols));
    }
    acc.assign(static_cast<size_t>(cols), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      if (row_scales[i] == 0.0f) continue;
      const double inv = 1.0 / row_scales[i];
      const float* row = wr.data() + i * cols;
      for (int64_t j = 0; j < cols; ++j) acc[j] += (row[j] * inv) * (row[j] * inv);
    }
    for (int64_t j = 0; j < cols; ++j) col_scales[j] = static_cast<float>(std::sqrt(acc[j] / rows));
  }
}

// Per-cell sums of the targets each code was chosen for: the Lloyd update of a codebook
// refit (base level = mean 2-bit target of its cell, 4-bit level = mean 4-bit target).
struct CellMeans {
  std::array<double, kBaseLevels> base_sum{}, base_count{};
  std::array<double, kBaseLevels * kResidualLevels> sub_sum{}, sub_count{};
};

// One quantisation of z (rows x cols) with codebook cb. Without a feedback factor u this is
// plain nearest-code rounding; with it, column-by-column LDLQ where x2 carries the 2-bit
// errors and x4 the 4-bit errors (each precision gets exact feedback; the base choice
// blends them, ChooseNested).
CellMeans QuantizePass(const NestedCodebook& cb, const std::vector<double>& z,
                       const std::vector<double>& u, int64_t rows, int64_t cols,
                       std::vector<uint8_t>& base, std::vector<uint8_t>& residual) {
  CellMeans means;
  auto record = [&](int64_t k, NestedChoice c, double x2, double x4) {
    base[k] = c.base;
    residual[k] = c.residual;
    means.base_sum[c.base] += x2;
    means.base_count[c.base] += 1.0;
    const int s = c.base * kResidualLevels + c.residual;
    means.sub_sum[s] += x4;
    means.sub_count[s] += 1.0;
  };
  if (u.empty()) {
    for (int64_t k = 0; k < rows * cols; ++k) record(k, ChooseNested(cb, z[k], z[k]), z[k], z[k]);
    return means;
  }
  // GPTQ's lazy batch updates: errors of a block of kFeedbackBlock columns are applied
  // inside the block at once and to the columns after it in one pass per row, tile by tile,
  // so each row's tail is streamed once per block instead of once per column. The order of
  // the subtractions per weight is unchanged (ascending j), so the result is bit-identical
  // to the column-at-a-time loop.
  std::vector<double> x2 = z;
  std::vector<double> x4 = z;
  std::vector<double> e2(static_cast<size_t>(rows * kFeedbackBlock));
  std::vector<double> e4(static_cast<size_t>(rows * kFeedbackBlock));
  for (int64_t j0 = 0; j0 < cols; j0 += kFeedbackBlock) {
    const int64_t j1 = std::min(cols, j0 + kFeedbackBlock);
    for (int64_t j = j0; j < j1; ++j) {
      const double* uj = u.data() + j * cols;
      const double inv_d = 1.0 / uj[j];
      for (int64_t i = 0; i < rows; ++i) {
        double* r2 = x2.data() + i * cols;
        double* r4 = x4.data() + i * cols;
        const NestedChoice c = ChooseNested(cb, r2[j], r4[j]);
        record(i * cols + j, c, r2[j], r4[j]);
        const double d2 = (r2[j] - cb.base[c.base]) * inv_d;
        const double d4 = (r4[j] - cb.Level4(c.base, c.residual)) * inv_d;
        e2[i * kFeedbackBlock + (j - j0)] = d2;
        e4[i * kFeedbackBlock + (j - j0)] = d4;
        for (int64_t k = j + 1; k < j1; ++k) {
          r2[k] -= d2 * uj[k];
          r4[k] -= d4 * uj[k];
        }
      }
    }
    for (int64_t k0 = j1; k0 < cols; k0 += kFeedbackTile) {
      const int64_t k1 = std::min(cols, k0 + kFeedbackTile);
      for (int64_t i = 0; i < rows; ++i) {
        double* r2 = x2.data() + i * cols;
        double* r4 = x4.data() + i * cols;
        for (int64_t j = j0; j < j1; ++j) {
          const double d2 = e2[i * kFeedbackBlock + (j - j0)];
          const double d4 = e4[i * kFeedbackBlock + (j - j0)];
          const double* uj = u.data() + j * cols;
          for (int64_t k = k0; k < k1; ++k) {
            r2[k] -= d2 * uj[k];
            r4[k] -= d4 * uj[k];
          }
        }
      }
    }
  }
  return means;
}

// The Lloyd update of cb from the targets of one pass; empty cells keep their levels.
NestedCodebook Refit(const NestedCodebook& cb, const CellMeans& means) {
  NestedCodebook out = cb;
  for (int b = 0; b < kBaseLevels; ++b) {
    if (means.base_count[b] > 0) out.base[b] = static_cast<float>(means.base_sum[b] / means.base_count[b]);
    for (int r = 0; r < kResidualLevels; ++r) {
      const int s = b * kResidualLevels + r;
      const double level = means.sub_count[s] > 0 ? means.sub_sum[s] / means.sub_count[s]
                                                   : cb.Level4(b, r);
      out.residual[s] = static_cast<float>(level - out.base[b]);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<EncodedMatrix> NestedScalarCodec::Encode(std::span<const float> w, int64_t rows,
                                                        int64_t cols, const Hessian* hessian,
                                                        const EncodeOptions& options) const {
  RETURN_IF_ERROR(ValidateInput(w, rows, cols, options));

  EncodedMatrix m;
  m.rows = rows;
  m.cols = cols;
  ASSIGN_OR_RETURN(m.params, DefaultParams(options.lambda, options.rotation));
  ASSIGN_OR_RETURN(const NestedCodebook cb, DesignNestedCodebook(options.lambda));

  std::vector<float> wr(w.begin(), w.end());
  RETURN_IF_ERROR(RotateMatrix(wr, rows, cols, options.rotation));
  FoldScales(wr, rows, cols, options.scale_passes, m.row_scales, m.col_scales);

  // The feedback factor in the scaled domain: error in W' of row i is
  // row_scale_i * C (z - z_hat), so every row sees H_z = C (R H R^T) C.
  // An all-zero matrix has all-zero scales and codes nothing; it needs no feedback.
  std::vector<double> u;
  const bool all_zero = std::all_of(m.col_scales.begin(), m.col_scales.end(),
                                    [](float c) { return c == 0.0f; });
  if (hessian != nullptr) RETURN_IF_ERROR(ValidateHessian(*hessian, cols));
  if (hessian != nullptr && !all_zero) {
    Hessian hz = *hessian;
    RETURN_IF_ERROR(RotateSymmetric(hz.values, cols, options.rotation.col_block,
                                    options.rotation.col_sign_seed));
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t k = 0; k < cols; ++k) {
        hz.values[j * cols + k] *= static_cast<double>(m.col_scales[j]) * m.col_scales[k];
      }
    }
    // A zero column scale makes H_z singular there; damping keeps it definite.
    ASSIGN_OR_RETURN(u, FeedbackFactor(hz, options.damping));
  }

  // The scaled, rotated weights Z, the quantiser's input.
  std::vector<double> z(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    const double inv_r = m.row_scales[i] > 0 ? 1.0 / m.row_scales[i] : 0.0;
    for (int64_t j = 0; j < cols; ++j) {
      const double inv_c = m.col_scales[j] > 0 ? 1.0 / m.col_scales[j] : 0.0;
      z[i * cols + j] = wr[i * cols + j] * inv_r * inv_c;
    }
  }
  std::vector<uint8_t> base(static_cast<size_t>(rows * cols));
  std::vector<uint8_t> residual(static_cast<size_t>(rows * cols));
  NestedCodebook fitted = cb;
  for (int pass = 0; pass <= options.codebook_refinements; ++pass) {
    const CellMeans means = QuantizePass(fitted, z, u, rows, cols, base, residual);
    if (pass < options.codebook_refinements) fitted = Refit(fitted, means);
  }
  m.params.base_codebook.assign(fitted.base.begin(), fitted.base.end());
  m.params.residual_codebook.assign(fitted.residual.begin(), fitted.residual.end());

  m.base_codes = PackCodes(base, kCodeBits);
  if (options.keep_residual) m.residual_codes = PackCodes(residual, kCodeBits);
  return m;
}

absl::StatusOr<CodecParams> NestedScalarCodec::DefaultParams(double lambda,
                                                             const RotationParams& rotation) {
  ASSIGN_OR_RETURN(const NestedCodebook cb, DesignNestedCodebook(lambda));
  CodecParams p;
  p.codec = std::string(kNestedScalarV1);
  p.base_bits = kCodeBits;
  p.residual_bits = kCodeBits;
  p.rotation = rotation;
  p.lambda = lambda;
  p.base_codebook.assign(cb.base.begin(), cb.base.end());
  p.residual_codebook.assign(cb.residual.begin(), cb.residual.end());
  return p;
}

absl::Status NestedScalarCodec::Decode(const EncodedMatrix& m, Precision precision,
                                       std::span<float> out) const {
  const int64_t rows = m.rows;
  const int64_t cols = m.cols;
  if (m.params.codec != name()) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix was encoded by '", m.params.codec, "', not '", name(), "'"));
  }
  if (m.params.base_bits != kCodeBits || m.params.residual_bits != kCodeBits) {
    return absl::InvalidArgumentError(absl::StrCat("nested_scalar_v1 codes are 2+2 bits, got ",
                                                   m.params.base_bits, "+",
                                                   m.params.residual_bits));
  }
  if (rows <= 0 || cols <= 0 || static_cast<int64_t>(out.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("output holds ", out.size(),
                                                   " values, expected ", rows, " x ", cols));
  }
  if (static_cast<int64_t>(m.base_codes.size()) != BasePlaneBytes(m) ||
      static_cast<int64_t>(m.row_scales.size()) != rows ||
      static_cast<int64_t>(m.col_scales.size()) != cols ||
      m.params.base_codebook.size() != kBaseLevels ||
      m.params.residual_codebook.size() != kBaseLevels * kResidualLevels) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoded matrix is inconsistent: base plane ", m.base_codes.size(),
                     " bytes (expected ", BasePlaneBytes(m), "), scales ", m.row_scales.size(),
                     "/", m.col_scales.size(), ", codebooks ", m.params.base_codebook.size(),
                     "/", m.params.residual_codebook.size()));
  }
  const bool four_bit = precision == Precision::k4Bit;
  if (four_bit) {
    if (!m.has_residual()) {
      return absl::FailedPreconditionError(
          "4-bit decode needs the residual plane, which this matrix does not hold");
    }
    if (static_cast<int64_t>(m.residual_codes.size()) != ResidualPlaneBytes(m)) {
      return absl::InvalidArgumentError(absl::StrCat("residual plane has ",
                                                     m.residual_codes.size(),
                                                     " bytes, expected ", ResidualPlaneBytes(m)));
    }
  }
  const std::vector<float>& cbb = m.params.base_codebook;
  const std::vector<float>& cbr = m.params.residual_codebook;
  for (int64_t i = 0; i < rows; ++i) {
    const float rs = m.row_scales[i];
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t k = i * cols + j;
      const uint8_t b = UnpackCode(m.base_codes, k, kCodeBits);
      float v = cbb[b];
      if (four_bit) v += cbr[b * kResidualLevels + UnpackCode(m.residual_codes, k, kCodeBits)];
      out[k] = rs * v * m.col_scales[j];
    }
  }
  return UnrotateMatrix(out, rows, cols, m.params.rotation);
}

}  // namespace nq::quant
