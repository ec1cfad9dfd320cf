// Weight-only NVFP4 quantization in ModelOpt's layout (nvfp4_format.h), with a per-block search
// over E4M3 block scales and the per-tensor error statistics `nq nvfp4 quantize --tap` writes.
//
// The global scale is ModelOpt's: weight_scale_2 = amax(|W|) / (6 * 448), so the largest block's
// ideal scale is exactly 448. A block's ideal scale is amax(|block|) / (6 * weight_scale_2):
// the scale that maps the block's largest magnitude onto E2M1's largest value, 6.
//   kOff      the stock recipe: the ideal scale clamped to [2^-9, 448] and rounded to nearest
//             E4M3. Rounding down clips the block's largest weights to +-6 * scale.
//   kNonclip  every E4M3 scale from the ideal up to 1.75x the ideal, plus the smallest one that
//             clips nothing; keeps the one with the least squared error over the block among
//             those that clip nothing. No weight is ever clipped. (The global scale is nudged
//             up by ulps if float rounding would make even 448 clip the largest block.)
//   kClip     every E4M3 scale from 0.70x to 1.75x the ideal, the stock one and the first that
//             clips nothing; least squared error wins even if it clips. For measurement.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/nvfp4/nvfp4_format.h"

namespace nq::nvfp4 {

enum class ScaleSearch { kOff, kNonclip, kClip };

// "off" | "nonclip" | "clip"; INVALID_ARGUMENT naming the text otherwise.
absl::StatusOr<ScaleSearch> ParseScaleSearch(absl::string_view text);
absl::string_view ScaleSearchName(ScaleSearch search);

// Multiplier ranges of the searches (the numbers).
inline constexpr float kNonclipMaxMultiplier = 1.75f;
inline constexpr float kClipMinMultiplier = 0.70f;

struct QuantizeOptions {
  ScaleSearch search = ScaleSearch::kNonclip;
  // A fixed global scale instead of amax / 2688 (the gate/up repack's `requantize` mode). With
  // kNonclip it must leave room for the largest block at scale 448 (FAILED_PRECONDITION if not).
  std::optional<float> scale_2;
  int threads = 1;  // rows are split across threads; results do not depend on it
};

// What the tap reports for one tensor. Errors are of the dequantised weight against the input.
struct TensorStats {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t blocks = 0;
  double mse = 0.0;       // mean squared error per weight
  double rel_error = 0.0; // ||W - Q|| / ||W|| (0 for an all-zero W)
  double cosine = 1.0;    // <W, Q> / (||W|| ||Q||) (1 when either is zero)
  int64_t scale_clamps = 0;       // blocks whose ideal scale lay outside [2^-9, 448]
  int64_t clipped_blocks = 0;     // blocks with a weight beyond 6 * its scale
  int64_t clipped_weights = 0;
  double clipped_energy_share = 0.0;  // sum of clipped w^2 / sum of all w^2
  int64_t raised_blocks = 0;   // blocks whose chosen scale is above the stock (kOff) one
  double multiplier_mean = 1.0;  // chosen scale / ideal scale, over non-zero blocks
  double multiplier_min = 1.0;
  double multiplier_max = 1.0;
};

struct QuantizeResult {
  Nvfp4Tensor tensor;
  TensorStats stats;
};

// Quantizes a row-major [rows, cols] fp32 weight. INVALID_ARGUMENT for cols not a multiple of
// 16, a size mismatch or a non-finite weight.
absl::StatusOr<QuantizeResult> QuantizeNvfp4(std::span<const float> values, int64_t rows, int64_t cols,
                                             const QuantizeOptions& options = {});

// One JSON object on one line (no newline): {"tensor", "search", "rows", "cols", "cosine",
// "rel_error", "mse", "blocks", "scale_clamps", "clipped_blocks", "clipped_block_share",
// "clipped_weights", "clipped_energy_share", "raised_blocks", "multiplier": {"mean", "min", "max"}}.
std::string TapLine(absl::string_view tensor, ScaleSearch search, const TensorStats& stats);

}  // namespace nq::nvfp4
