#include "services/quant/nested_scalar_codec.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/quant/codec_prep.h"
#include "services/quant/nested_codebook.h"

namespace nq::quant {
namespace {

constexpr int kCodeBits = 2;
// LDLQ lazy-batch geometry: 128 columns per error block (GPTQ's blocksize) and 512-column
// tiles of the deferred update, so a block's U tile (128 x 512 doubles, 512 KiB) stays in
// L2 while the rows stream past it.
constexpr int64_t kFeedbackBlock = 128;
constexpr int64_t kFeedbackTile = 512;

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
  if (cb.grid == BaseGrid::kUniformNested) {
    return SnapToHalfGrid(UniformNestedCodebook(
        cb.lambda, FitUniformNestedStep(means.base_sum, means.base_count, means.sub_sum, means.sub_count, cb.lambda,
                                        cb.base[kBaseLevels - 1] - cb.base[kBaseLevels - 2])));
  }
  NestedCodebook out = cb;
  const double step = cb.grid == BaseGrid::kUniform
                          ? FitUniformStep(means.base_sum, means.base_count, cb.base[kBaseLevels - 1] - cb.base[kBaseLevels - 2])
                          : 0.0;
  for (int b = 0; b < kBaseLevels; ++b) {
    if (cb.grid == BaseGrid::kUniform) {
      out.base[b] = static_cast<float>(EvenGridLevel(step, b));
    } else if (means.base_count[b] > 0) {
      out.base[b] = static_cast<float>(means.base_sum[b] / means.base_count[b]);
    }
    for (int r = 0; r < kResidualLevels; ++r) {
      const int s = b * kResidualLevels + r;
      const double level = means.sub_count[s] > 0 ? means.sub_sum[s] / means.sub_count[s]
                                                   : cb.Level4(b, r);
      out.residual[s] = static_cast<float>(level - out.base[b]);
    }
  }
  return SnapToHalfGrid(out);
}

}  // namespace

absl::StatusOr<EncodedMatrix> NestedScalarCodec::Encode(std::span<const float> w, int64_t rows,
                                                        int64_t cols, const Hessian* hessian,
                                                        const EncodeOptions& options) const {
  RETURN_IF_ERROR(ValidateEncodeInput(w, rows, cols, options));
  if (options.codebook_refinements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("codebook_refinements must be >= 0, got ", options.codebook_refinements));
  }

  EncodedMatrix m;
  m.rows = rows;
  m.cols = cols;
  const BaseGrid grid = options.base_grid;
  ASSIGN_OR_RETURN(m.params, DefaultParams(options.lambda, grid, options.rotation));
  ASSIGN_OR_RETURN(const NestedCodebook cb, DesignNestedCodebook(options.lambda, grid));
  ASSIGN_OR_RETURN(PreparedMatrix prepared, PrepareMatrix(w, rows, cols, hessian, options));
  m.row_scales = std::move(prepared.row_scales);
  m.col_scales = std::move(prepared.col_scales);
  const std::vector<double>& z = prepared.z;
  const std::vector<double>& u = prepared.feedback;
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

absl::StatusOr<CodecParams> NestedScalarCodec::DefaultParams(double lambda, BaseGrid grid,
                                                             const RotationParams& rotation) {
  ASSIGN_OR_RETURN(const NestedCodebook cb, DesignNestedCodebook(lambda, grid));
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
  RETURN_IF_ERROR(ValidateDecodeInput(m, kNestedScalarV1, precision, out.size(), "codebooks", kBaseLevels,
                                      kBaseLevels * kResidualLevels));
  const bool four_bit = precision == Precision::k4Bit;
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
