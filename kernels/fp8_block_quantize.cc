#include "kernels/fp8_block_quantize.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace nq::kernels {
namespace {

constexpr float kE4M3Max = 448.0f;
constexpr std::uint8_t kE4M3MaxBits = 0x7e;  // S.1111.110

}  // namespace

F8E4M3 ToF8E4M3(float f) {
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return F8E4M3{static_cast<std::uint8_t>(sign | 0x7f)};
  const float a = std::fabs(f);
  if (a >= kE4M3Max) return F8E4M3{static_cast<std::uint8_t>(sign | kE4M3MaxBits)};
  // Subnormals (below 2^-6) are multiples of 2^-9: the code is the rounded multiple, and a
  // rounding up to 8 is exactly the smallest normal's code (exponent 1, mantissa 0).
  if (a < 0.015625f) {
    return F8E4M3{static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(std::nearbyint(a * 512.0f)))};
  }
  int e = 0;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exponent = e - 1 + 7;           // a = (2m) * 2^(e - 1), biased by 7
  int mantissa = static_cast<int>(std::nearbyint((2.0f * m - 1.0f) * 8.0f));  // exact product, ties to even
  if (mantissa == 8) {
    mantissa = 0;
    ++exponent;
  }
  if (exponent > 15 || (exponent == 15 && mantissa == 7)) return F8E4M3{static_cast<std::uint8_t>(sign | kE4M3MaxBits)};
  return F8E4M3{static_cast<std::uint8_t>(sign | (exponent << 3) | mantissa)};
}

absl::StatusOr<BlockScaledFp8> QuantizeBlockScaledFp8(std::span<const float> w, std::int64_t rows, std::int64_t cols) {
  if (rows < 0 || cols < 0 || static_cast<std::uint64_t>(w.size()) != static_cast<std::uint64_t>(rows) * cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeBlockScaledFp8: ", w.size(), " values for a [", rows, ", ", cols, "] matrix"));
  }
  constexpr std::int64_t kBlock = kWeightScaleBlock;
  const std::int64_t row_blocks = WeightScaleBlocks(rows), col_blocks = WeightScaleBlocks(cols);
  BlockScaledFp8 out{.scale_rows = row_blocks, .scale_cols = col_blocks};
  out.values.resize(w.size());
  out.scale_inv.resize(static_cast<std::size_t>(row_blocks * col_blocks));
  for (std::int64_t rb = 0; rb < row_blocks; ++rb) {
    const std::int64_t r_end = std::min(rows, (rb + 1) * kBlock);
    for (std::int64_t cb = 0; cb < col_blocks; ++cb) {
      const std::int64_t c_begin = cb * kBlock, c_end = std::min(cols, c_begin + kBlock);
      float amax = 0.0f;
      for (std::int64_t r = rb * kBlock; r < r_end; ++r) {
        for (std::int64_t c = c_begin; c < c_end; ++c) {
          const float v = w[static_cast<std::size_t>(r * cols + c)];
          if (!std::isfinite(v)) {
            return absl::InvalidArgumentError(
                absl::StrCat("QuantizeBlockScaledFp8: weight [", r, ", ", c, "] is ", v, "; FP8 needs finite weights"));
          }
          amax = std::max(amax, std::fabs(v));
        }
      }
      const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      out.scale_inv[static_cast<std::size_t>(rb * col_blocks + cb)] = scale;
      for (std::int64_t r = rb * kBlock; r < r_end; ++r) {
        for (std::int64_t c = c_begin; c < c_end; ++c) {
          const std::size_t i = static_cast<std::size_t>(r * cols + c);
          out.values[i] = ToF8E4M3(w[i] / scale);
        }
      }
    }
  }
  return out;
}

}  // namespace nq::kernels
