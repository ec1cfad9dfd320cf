// Fusing an expert's NVFP4 gate_proj and up_proj into the one [2 * I, H] gate/up matrix a
// fused MoE GEMV reads, with ONE global scale, per tensor-parallel rank.
//
// ModelOpt quantizes gate and up separately, so their weight_scale_2 values differ whenever
// their amax differ (7 of 10 experts on one real checkpoint, one by 10x). A repack that keeps
// the gate's global scale for both halves (kGateOnly, the well-known serving bug) scales the
// up half by gate_scale_2 / up_scale_2: the SiLU-gated product is wrong and generations turn
// into U+FFFD and broken tool-call JSON.
//
//   kCompensate  (default) fused global = the larger of the two; the other half's E4M3 block
//                scales are multiplied by (its global / fused global) <= 1 and rounded to
//                nearest E4M3, clamped to [2^-9, 448]; its E2M1 codes are kept. Compensating
//                toward the larger global never overflows 448 (compensating the up half toward
//                the gate's global would clamp every block whose product passes 448 when
//                up / gate > 1). The only loss is the re-rounding of the rescaled block
//                scales (at most 2^-4 relative for normal E4M3 values).
//   kRequantize  fused global = the larger one; the half with the smaller global is
//                dequantised and quantized again at the fused global (QuantizeNvfp4 with
//                `requantize_search`). For measurement.
//   kGateOnly    the gate's global for both halves, bytes copied: reproduces the bug.
//
// Tensor parallelism: gate/up are column-parallel, so rank r of W owns rows
// [r * I / W, (r + 1) * I / W) of BOTH halves; its fused matrix is those gate rows followed
// by those up rows (never rows [r * 2I / W, ...) of a fused full matrix, which would give one
// rank only gate rows and another only up rows).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/nvfp4/nvfp4_format.h"
#include "services/nvfp4/nvfp4_quantizer.h"

namespace nq::nvfp4 {

enum class GateUpScaleMode { kCompensate, kRequantize, kGateOnly };

// "compensate" | "requantize" | "gate_only"; INVALID_ARGUMENT otherwise.
absl::StatusOr<GateUpScaleMode> ParseGateUpScaleMode(absl::string_view text);
absl::string_view GateUpScaleModeName(GateUpScaleMode mode);

struct RepackOptions {
  GateUpScaleMode mode = GateUpScaleMode::kCompensate;
  int tp_rank = 0;
  int tp_size = 1;
  ScaleSearch requantize_search = ScaleSearch::kNonclip;
};

struct FusedGateUp {
  Nvfp4Tensor tensor;            // [2 * I / tp_size, H]: this rank's gate rows, then its up rows
  int64_t rescaled_blocks = 0;   // block scales rewritten (kCompensate) or requantized blocks
  int64_t clamped_blocks = 0;    // of those, scales clamped to [2^-9, 448]
};

// Both inputs [I, H] with the same shape; I % tp_size == 0; 0 <= tp_rank < tp_size.
// INVALID_ARGUMENT naming the rule otherwise (and for an invalid view).
absl::StatusOr<FusedGateUp> RepackGateUp(const Nvfp4View& gate, const Nvfp4View& up,
                                         const RepackOptions& options);

// Rows [begin, begin + count) of `view` (shares its bytes). Requires a valid view and range.
Nvfp4View SliceRows(const Nvfp4View& view, int64_t begin, int64_t count);

}  // namespace nq::nvfp4
