// FP8 rows of the MLA latent KV cache on the GPU (the layout and its host reference:
// kernels/kv_fp8.h): the pack kernel behind WriteRows, and the unpacking the attention kernels
// share. Both give the CPU backend's bits: a code is E4M3(x / scale) rounded to nearest even and
// saturated at 448 (NaN: sign | 0x7f), a value is float(E4M3 code) * scale, one fp32 rounding each.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/kv_fp8.h"

namespace nq::kernels::cuda {

// The attention kernels' tag for a cache of packed FP8 rows (U8 [keys, KvFp8RowBytes(c)]); its
// rope key is BF16.
struct KvFp8 {};

__device__ __forceinline__ float E4M3Value(std::uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = code;
  return static_cast<float>(v);
}

// Tile t's scale in `row` (the scales follow the c codes; c need not be a multiple of 4).
__device__ __forceinline__ float KvFp8Scale(const std::uint8_t* row, int c, int t) {
  const std::uint8_t* s = row + c + 4 * t;
  return __uint_as_float(std::uint32_t{s[0]} | (std::uint32_t{s[1]} << 8) | (std::uint32_t{s[2]} << 16) |
                         (std::uint32_t{s[3]} << 24));
}

// Latent value i of a packed row, as the CPU's UnpackKvFp8Row gives it.
__device__ __forceinline__ float KvFp8Value(const std::uint8_t* row, int c, int i) {
  return E4M3Value(row[i]) * KvFp8Scale(row, c, i / static_cast<int>(kKvFp8Tile));
}

// dst row (*row_offset or first_row) + i = PackKvFp8Row(src row i). Rows at or past dst_rows are
// dropped (as WriteRowsAt drops them).
struct PackKvFp8RowsParams {
  const float* src = nullptr;  // [rows, c]
  std::uint8_t* dst = nullptr;  // [dst_rows, KvFp8RowBytes(c)]
  const std::int32_t* row_offset = nullptr;  // device, or null: first_row
  std::int64_t first_row = 0;
  std::int64_t rows = 0;
  std::int64_t c = 0;
  std::int64_t dst_rows = 0;
};

// Contract: rows < 2^31 (one block per row), 0 <= c < 2^31.
absl::Status LaunchPackKvFp8Rows(const PackKvFp8RowsParams& params, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
