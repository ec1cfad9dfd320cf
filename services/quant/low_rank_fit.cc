#include "services/quant/low_rank_fit.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/quant/hadamard.h"

namespace nq::quant {
namespace {

// (w - decode(m, precision)) rotated: the codec's error in the domain the factors live in.
absl::StatusOr<std::vector<float>> RotatedError(const Codec& codec, const EncodedMatrix& m, std::span<const float> w,
                                                Precision precision) {
  std::vector<float> e(static_cast<size_t>(m.rows * m.cols));
  RETURN_IF_ERROR(codec.Decode(m, precision, e));
  for (size_t k = 0; k < e.size(); ++k) e[k] = w[k] - e[k];
  RETURN_IF_ERROR(RotateMatrix(e, m.rows, m.cols, m.params.rotation));
  return e;
}

}  // namespace

absl::StatusOr<CorrectionFit> FitCorrection(const Codec& codec, const EncodedMatrix& m, std::span<const float> w,
                                            const Hessian* hessian, const LowRankOptions& options) {
  CorrectionFit fit;
  if (options.rank < 0 || options.rank > kMaxLowRank) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank rank ", options.rank, " is outside [0, ", kMaxLowRank, "]"));
  }
  if (static_cast<int64_t>(w.size()) != m.rows * m.cols) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank fit: ", w.size(), " weights for a ", m.rows, " x ", m.cols,
                                                   " matrix"));
  }
  if (options.rank == 0 || hessian == nullptr) return fit;
  RETURN_IF_ERROR(ValidateHessian(*hessian, m.cols));
  fit.outliers = FindOutlierChannels(*hessian, options.outlier_threshold);
  if (fit.outliers.count == 0) return fit;
  if (!m.has_residual()) {
    return absl::FailedPreconditionError("low-rank fit needs the residual plane to fit the 4-bit level");
  }
  Hessian rotated = *hessian;
  RETURN_IF_ERROR(RotateSymmetric(rotated.values, m.cols, m.params.rotation.col_block, m.params.rotation.col_sign_seed));

  // Two full tr(E H E^T) products per matrix (rows x cols^2 each); the corrected errors come from
  // them and the factors (WeightedErrorAfter).
  ASSIGN_OR_RETURN(std::vector<float> e2, RotatedError(codec, m, w, Precision::k2Bit));
  ASSIGN_OR_RETURN(LowRankFactors base, FitLowRank(e2, m.rows, m.cols, &rotated, options.rank, options.damping));
  fit.error2 = WeightedError(e2, m.rows, m.cols, &rotated);
  const LowRankFactors* base_only[] = {&base};
  fit.error2_corrected = WeightedErrorAfter(e2, m.rows, m.cols, &rotated, fit.error2, base_only);

  // The 4-bit level sees the base factors too (a READY slot applies both), so its factors fit
  // what is left of the 4-bit error after them.
  ASSIGN_OR_RETURN(std::vector<float> e4, RotatedError(codec, m, w, Precision::k4Bit));
  fit.error4 = WeightedError(e4, m.rows, m.cols, &rotated);
  std::vector<float> left = e4;
  SubtractLowRank(base, left);
  ASSIGN_OR_RETURN(LowRankFactors residual, FitLowRank(left, m.rows, m.cols, &rotated, options.rank, options.damping));
  const LowRankFactors* both[] = {&base, &residual};
  fit.error4_corrected = WeightedErrorAfter(e4, m.rows, m.cols, &rotated, fit.error4, both);

  if (fit.error2 > 0 && (fit.error2 - fit.error2_corrected) >= options.min_gain * fit.error2) {
    fit.correction = {.base = std::move(base), .residual = std::move(residual)};
  }
  return fit;
}

absl::Status DecodeCorrected(const Codec& codec, const EncodedMatrix& m, const LowRankCorrection& correction,
                             Precision precision, std::span<float> out) {
  RETURN_IF_ERROR(codec.Decode(m, precision, out));
  if (correction.empty()) return absl::OkStatus();
  const bool four = precision == Precision::k4Bit;
  if (correction.base.rows != m.rows || correction.base.cols != m.cols ||
      (four && (correction.residual.rows != m.rows || correction.residual.cols != m.cols))) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank correction of ", correction.base.rows, " x ",
                                                   correction.base.cols, " for a ", m.rows, " x ", m.cols, " matrix"));
  }
  std::vector<float> delta(static_cast<size_t>(m.rows * m.cols), 0.0f);
  AddLowRank(correction.base, delta);
  if (four) AddLowRank(correction.residual, delta);
  RETURN_IF_ERROR(UnrotateMatrix(delta, m.rows, m.cols, m.params.rotation));
  for (size_t k = 0; k < delta.size(); ++k) out[k] += delta[k];
  return absl::OkStatus();
}

}  // namespace nq::quant
