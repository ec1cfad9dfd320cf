// Fitting and applying a matrix's low-rank correction (low_rank.h) around a codec: decode the
// codec's 2-bit and 4-bit weights, fit the base level's factors to the 2-bit error and the
// residual level's to the 4-bit error left after them, both in the rotated domain with the
// rotated Hessian. The encoder calls FitCorrection per expert matrix; decoders call
// DecodeCorrected.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/quant/codec.h"
#include "services/quant/ldlq.h"
#include "services/quant/low_rank.h"

namespace nq::quant {

struct LowRankOptions {
  // 0: no corrections (the default: a release without them is byte-identical to one written
  // before they existed). 1..kMaxLowRank otherwise.
  int rank = 0;
  // A matrix is considered only when some input channel's Hessian diagonal exceeds this multiple
  // of the median diagonal (FindOutlierChannels). Without a Hessian there is nothing to detect.
  double outlier_threshold = 8.0;
  // ...and kept only when the base factors lower the Hessian-weighted 2-bit error by at least this
  // fraction: below it the bytes buy too little.
  double min_gain = 0.02;
  // Damping of H in the fit, relative to its mean diagonal (as LDLQ's).
  double damping = 0.01;
};

// What the fit found, for the encoder's log and the decision.
struct CorrectionFit {
  LowRankCorrection correction;  // empty when not kept
  OutlierChannels outliers;
  // tr(E H E^T) of the 2-bit and 4-bit errors without and with the correction (the "with" values
  // are those of the fitted factors even when not kept; 0 when no fit ran).
  double error2 = 0, error2_corrected = 0;
  double error4 = 0, error4_corrected = 0;
};

// Fits `m`'s correction for the original weights w (rows x cols) and their Hessian (cols x cols,
// original domain; null: no correction). `m` must hold its residual plane.
absl::StatusOr<CorrectionFit> FitCorrection(const Codec& codec, const EncodedMatrix& m, std::span<const float> w,
                                            const Hessian* hessian, const LowRankOptions& options);

// codec.Decode(m, precision) plus the correction's levels that `precision` includes (the base
// factors at 2 bits, both at 4), unrotated with m's rotation. An empty correction decodes as
// codec.Decode does. InvalidArgument for factors of another shape.
absl::Status DecodeCorrected(const Codec& codec, const EncodedMatrix& m, const LowRankCorrection& correction,
                             Precision precision, std::span<float> out);

}  // namespace nq::quant
