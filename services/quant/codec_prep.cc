#include "services/quant/codec_prep.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::quant {
namespace {

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

}  // namespace

absl::Status ValidateEncodeInput(std::span<const float> w, int64_t rows, int64_t cols,
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
  for (float v : w) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError("weights hold a non-finite value");
  }
  return absl::OkStatus();
}

absl::StatusOr<PreparedMatrix> PrepareMatrix(std::span<const float> w, int64_t rows, int64_t cols,
                                             const Hessian* hessian, const EncodeOptions& options) {
  PreparedMatrix p;
  std::vector<float> wr(w.begin(), w.end());
  RETURN_IF_ERROR(RotateMatrix(wr, rows, cols, options.rotation));
  FoldScales(wr, rows, cols, options.scale_passes, p.row_scales, p.col_scales);

  // The feedback factor in the scaled domain: error in W' of row i is
  // row_scale_i * C (z - z_hat), so every row sees H_z = C (R H R^T) C.
  // An all-zero matrix has all-zero scales and codes nothing; it needs no feedback.
  const bool all_zero = std::all_of(p.col_scales.begin(), p.col_scales.end(),
                                    [](float c) { return c == 0.0f; });
  if (hessian != nullptr) RETURN_IF_ERROR(ValidateHessian(*hessian, cols));
  if (hessian != nullptr && !all_zero) {
    Hessian hz = *hessian;
    RETURN_IF_ERROR(RotateSymmetric(hz.values, cols, options.rotation.col_block,
                                    options.rotation.col_sign_seed));
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t k = 0; k < cols; ++k) {
        hz.values[j * cols + k] *= static_cast<double>(p.col_scales[j]) * p.col_scales[k];
      }
    }
    // A zero column scale makes H_z singular there; damping keeps it definite.
    ASSIGN_OR_RETURN(p.feedback, FeedbackFactor(hz, options.damping));
  }

  p.z.resize(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    const double inv_r = p.row_scales[i] > 0 ? 1.0 / p.row_scales[i] : 0.0;
    for (int64_t j = 0; j < cols; ++j) {
      const double inv_c = p.col_scales[j] > 0 ? 1.0 / p.col_scales[j] : 0.0;
      p.z[i * cols + j] = wr[i * cols + j] * inv_r * inv_c;
    }
  }
  return p;
}

absl::Status ValidateDecodeInput(const EncodedMatrix& m, absl::string_view codec, Precision precision,
                                 size_t out_size, absl::string_view codebooks, size_t base_codebook,
                                 size_t residual_codebook) {
  constexpr int kCodeBits = 2;
  const int64_t rows = m.rows, cols = m.cols;
  if (m.params.codec != codec) {
    return absl::InvalidArgumentError(absl::StrCat("matrix was encoded by '", m.params.codec, "', not '", codec, "'"));
  }
  if (m.params.base_bits != kCodeBits || m.params.residual_bits != kCodeBits) {
    return absl::InvalidArgumentError(
        absl::StrCat(codec, " codes are 2+2 bits, got ", m.params.base_bits, "+", m.params.residual_bits));
  }
  if (rows <= 0 || cols <= 0 || static_cast<int64_t>(out_size) != rows * cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("output holds ", out_size, " values, expected ", rows, " x ", cols));
  }
  if (static_cast<int64_t>(m.base_codes.size()) != BasePlaneBytes(m) ||
      static_cast<int64_t>(m.row_scales.size()) != rows || static_cast<int64_t>(m.col_scales.size()) != cols ||
      m.params.base_codebook.size() != base_codebook || m.params.residual_codebook.size() != residual_codebook) {
    return absl::InvalidArgumentError(absl::StrCat(
        "encoded matrix is inconsistent: base plane ", m.base_codes.size(), " bytes (expected ", BasePlaneBytes(m),
        "), scales ", m.row_scales.size(), "/", m.col_scales.size(), ", ", codebooks, " ",
        m.params.base_codebook.size(), "/", m.params.residual_codebook.size(), " (expected ",
        base_codebook == residual_codebook ? absl::StrCat(base_codebook, " each")
                                           : absl::StrCat(base_codebook, "/", residual_codebook),
        ")"));
  }
  if (precision == Precision::k4Bit) {
    if (!m.has_residual()) {
      return absl::FailedPreconditionError("4-bit decode needs the residual plane, which this matrix does not hold");
    }
    if (static_cast<int64_t>(m.residual_codes.size()) != ResidualPlaneBytes(m)) {
      return absl::InvalidArgumentError(absl::StrCat("residual plane has ", m.residual_codes.size(),
                                                     " bytes, expected ", ResidualPlaneBytes(m)));
    }
  }
  return absl::OkStatus();
}

}  // namespace nq::quant
