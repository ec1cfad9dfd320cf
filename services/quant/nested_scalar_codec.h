// nested_scalar_v1: the first NestQuant codec (DESIGN.md section 6).
//
// Encode: W' = R_rows W R_cols^T (random signs + blockwise Hadamard, hadamard.h); scales
// folded so Z = diag(1/row_scales) W' diag(1/col_scales) has unit RMS per row and column
// (near N(0,1)); each z quantised to a nested code (b, r) from the blended Gaussian codebook
// (nested_codebook.h) with LDLQ error feedback against H_z = C (R H R^T) C, C =
// diag(col_scales). The 2-bit and the 4-bit reconstructions each carry their own feedback
// stream; the base code is chosen on the blend of both. The residual is always computed and
// only then kept or dropped, so the base plane never depends on it.
#pragma once

#include "services/quant/codec.h"
#include "services/quant/nested_codebook.h"

namespace nq::quant {

inline constexpr absl::string_view kNestedScalarV1 = "nested_scalar_v1";

class NestedScalarCodec final : public Codec {
 public:
  std::string name() const override { return std::string(kNestedScalarV1); }

  absl::StatusOr<EncodedMatrix> Encode(std::span<const float> w, int64_t rows, int64_t cols,
                                       const Hessian* hessian,
                                       const EncodeOptions& options) const override;

  absl::Status Decode(const EncodedMatrix& m, Precision precision,
                      std::span<float> out) const override;

  // The CodecParams an Encode with codebook_refinements = 0 records, rebuilt from what a
  // manifest holds (lambda, base grid, rotation): lets a reader assemble an EncodedMatrix from
  // the resident planes and scales without storing the codebooks.
  static absl::StatusOr<CodecParams> DefaultParams(double lambda, BaseGrid grid, const RotationParams& rotation);
};

}  // namespace nq::quant
