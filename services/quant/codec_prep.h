// The steps every NestQuant codec shares before it quantises (DESIGN.md section 6): input
// checks, the two-sided rotation, folded row/column scales, the scaled targets Z and the
// LDLQ feedback factor in Z's domain. nested_scalar_v1 and trellis_v1 both start here, so a
// release's scales mean the same thing whichever codec wrote it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/quant/codec.h"

namespace nq::quant {

// Non-empty shape matching w, rotation blocks that divide it, scale_passes >= 1, finite
// weights. InvalidArgument naming the first problem.
absl::Status ValidateEncodeInput(std::span<const float> w, int64_t rows, int64_t cols,
                                 const EncodeOptions& options);

// The rotated, scaled matrix: W' = R_rows W R_cols^T ~= diag(row_scales) Z diag(col_scales).
struct PreparedMatrix {
  std::vector<float> row_scales;
  std::vector<float> col_scales;
  std::vector<double> z;  // rows x cols, row-major, near unit RMS per row and column
  // LDLQ factor of H_z = C (R H R^T) C, C = diag(col_scales) (ldlq.h's FeedbackFactor);
  // empty without a Hessian or for an all-zero matrix (nothing to feed back).
  std::vector<double> feedback;
};

// Rotates w, folds the scales (options.scale_passes alternating RMS passes) and, given a
// Hessian (cols x cols), builds the feedback factor with options.damping.
absl::StatusOr<PreparedMatrix> PrepareMatrix(std::span<const float> w, int64_t rows, int64_t cols,
                                             const Hessian* hessian, const EncodeOptions& options);

// The checks every codec's Decode makes before it reads a plane: `m` was written by `codec`
// with 2 + 2-bit codes, out holds rows x cols values, the base plane, scales and the two
// codebooks have their sizes (base_codebook / residual_codebook entries, the codec's own), and
// a 4-bit decode has a residual plane of its size (FAILED_PRECONDITION without one).
// INVALID_ARGUMENT naming the first problem otherwise.
// `codebooks` names them in errors ("codebooks", "gains").
absl::Status ValidateDecodeInput(const EncodedMatrix& m, absl::string_view codec, Precision precision,
                                 size_t out_size, absl::string_view codebooks, size_t base_codebook,
                                 size_t residual_codebook);

}  // namespace nq::quant
