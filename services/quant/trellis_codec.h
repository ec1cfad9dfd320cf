// trellis_v1 (issue #16): a QTIP-style bitshift-trellis codec behind the Codec interface.
//
// Shared with nested_scalar_v1 (codec_prep.h): the sign + Hadamard rotation on both sides
// and the folded row/column scales, so the quantiser sees Z ~ N(0, 1).
//
// Base (2 bits/weight): every 16 x 16 tile of Z is one tail-biting ring of the L = 16,
// K = 2 trellis with the computed codebook of trellis_decode.h, coded by Viterbi search
// (trellis_viterbi.h). Residual (2 more bits): a second trellis of the same kind codes the
// 4-bit target minus the decoded base, so the 4-bit weight is base + residual and the base
// plane never depends on the residual (it is computed first and only then kept or dropped).
//
// Gains: each 16-column block tj of tiles has its own base gain and residual gain
// (CodecParams::base_codebook[tj], residual_codebook[tj]), the RMS of the block's targets
// times the gain that minimises the trellis's MSE on a unit Gaussian. 2 x 32 bits per
// 16 x rows weights: 0.002 bits/weight at rows = 2048.
//
// LDLQ (block form, as QTIP): columns go in blocks of 16. A block's tiles are searched on
// their current targets, then the block's error e (rows x 16) is fed forward to the later
// columns as x_K -= e U_JJ^-1 U_JK, U the feedback factor (ldlq.h). The 2-bit and the 4-bit
// reconstructions each carry their own feedback stream (x2, x4); the base is searched on
// lambda * x2 + (1 - lambda) * x4 and the residual on x4 - base, so the 4-bit level can
// follow its own stream anywhere instead of being held inside the base's cell.
#pragma once

#include "services/quant/codec.h"

namespace nq::quant {

inline constexpr absl::string_view kTrellisV1 = "trellis_v1";

class TrellisCodec final : public Codec {
 public:
  std::string name() const override { return std::string(kTrellisV1); }

  // Beyond the scalar codec's checks: rows and cols multiples of 16 (whole tiles), and
  // codebook_refinements = 0 (the codebook is computed, there is nothing to refit).
  absl::StatusOr<EncodedMatrix> Encode(std::span<const float> w, int64_t rows, int64_t cols,
                                       const Hessian* hessian,
                                       const EncodeOptions& options) const override;

  absl::Status Decode(const EncodedMatrix& m, Precision precision,
                      std::span<float> out) const override;
};

}  // namespace nq::quant
