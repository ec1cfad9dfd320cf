#include "kernels/cuda/kv_fp8.cuh"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/launch_dependent.cuh"

namespace nq::kernels::cuda {
namespace {

// One warp per 128-value tile: each lane holds 4 values, the warp finds the tile's largest
// magnitude, then each lane writes its codes. A block covers a row.
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kPerLane = static_cast<int>(kKvFp8Tile) / kWarpSize;
constexpr float kE4M3Max = 448.0f;

__device__ __forceinline__ std::uint8_t E4M3Code(float v) {
  // cvt's saturating round to nearest even; NaN is the host's sign | 0x7f.
  if (isnan(v)) return signbit(v) ? std::uint8_t{0xff} : std::uint8_t{0x7f};
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__global__ void __launch_bounds__(kThreads) PackKvFp8RowsKernel(const __grid_constant__ PackKvFp8RowsParams p) {
  StartAsProgrammaticDependent();
  const std::int64_t row = (p.row_offset != nullptr ? std::int64_t{*p.row_offset} : p.first_row) + blockIdx.x;
  if (row < 0 || row >= p.dst_rows) return;
  const int c = static_cast<int>(p.c);
  const float* src = p.src + blockIdx.x * p.c;
  const std::int64_t width = KvFp8RowBytes(p.c);
  std::uint8_t* dst = p.dst + row * width;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int t = warp; t < static_cast<int>(KvFp8Tiles(p.c)); t += kWarps) {
    const int begin = t * static_cast<int>(kKvFp8Tile);
    float x[kPerLane];
    float amax = 0.0f;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = begin + lane + kWarpSize * j;
      x[j] = i < c ? __ldg(src + i) : 0.0f;
      nan |= isnan(x[j]);
      amax = fmaxf(amax, fabsf(x[j]));  // fmaxf drops a NaN, as the host's std::max does
    }
    amax = WarpMax(amax);
    nan = __any_sync(kFullWarpMask, nan);
    const float scale = nan ? __int_as_float(0x7fc00000) : __fdiv_rn(amax, kE4M3Max);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = begin + lane + kWarpSize * j;
      if (i < c) dst[i] = scale > 0.0f ? E4M3Code(__fdiv_rn(x[j], scale)) : E4M3Code(nan ? x[j] : 0.0f);
    }
    if (lane < 4) {
      const std::uint32_t bits = __float_as_uint(scale);
      dst[c + 4 * t + lane] = static_cast<std::uint8_t>(bits >> (8 * lane));
    }
  }
  const std::int64_t used = p.c + 4 * KvFp8Tiles(p.c);
  for (std::int64_t i = used + threadIdx.x; i < width; i += kThreads) dst[i] = 0;
}

}  // namespace

absl::Status LaunchPackKvFp8Rows(const PackKvFp8RowsParams& p, const LaunchContext& ctx) {
  if (p.rows < 0 || p.rows > kMaxGridX || p.c < 0 || p.c > (std::int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteRows: unsupported size for FP8 rows rows=", p.rows, " c=", p.c));
  }
  if (p.rows == 0 || p.c == 0) return absl::OkStatus();
  RETURN_IF_ERROR(
      LaunchProgrammaticDependent(PackKvFp8RowsKernel, dim3(static_cast<unsigned>(p.rows)), dim3(kThreads), 0, ctx, p));
  return CheckLaunch("PackKvFp8RowsKernel");
}

}  // namespace nq::kernels::cuda
