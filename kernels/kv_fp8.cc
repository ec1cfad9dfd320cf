#include "kernels/kv_fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/dtype.h"
#include "kernels/fp8_block_quantize.h"

namespace nq::kernels {

namespace {
constexpr float kE4M3Max = 448.0f;
}  // namespace

void PackKvFp8Row(const float* x, std::int64_t c, std::uint8_t* row) {
  for (std::int64_t t = 0; t < KvFp8Tiles(c); ++t) {
    const std::int64_t begin = t * kKvFp8Tile, end = std::min(c, begin + kKvFp8Tile);
    float amax = 0.0f;
    bool nan = false;
    for (std::int64_t i = begin; i < end; ++i) {
      nan |= std::isnan(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / kE4M3Max;
    for (std::int64_t i = begin; i < end; ++i) {
      row[i] = scale > 0 ? ToF8E4M3(x[i] / scale).bits : ToF8E4M3(nan ? x[i] : 0.0f).bits;
    }
    std::memcpy(row + c + t * static_cast<std::int64_t>(sizeof(float)), &scale, sizeof(float));
  }
  const std::int64_t used = c + static_cast<std::int64_t>(sizeof(float)) * KvFp8Tiles(c);
  std::memset(row + used, 0, static_cast<std::size_t>(KvFp8RowBytes(c) - used));
}

void UnpackKvFp8Row(const std::uint8_t* row, std::int64_t c, float* x) {
  for (std::int64_t t = 0; t < KvFp8Tiles(c); ++t) {
    float scale;
    std::memcpy(&scale, row + c + t * static_cast<std::int64_t>(sizeof(float)), sizeof(float));
    const std::int64_t begin = t * kKvFp8Tile, end = std::min(c, begin + kKvFp8Tile);
    for (std::int64_t i = begin; i < end; ++i) x[i] = ToFloat(F8E4M3{row[i]}) * scale;
  }
}

}  // namespace nq::kernels
