// FP8 rows of the MLA latent KV cache (--kv_cache_dtype fp8, issue #13), in the layout DeepSeek's
// FlashMLA and vLLM's "fp8_ds_mla" cache use for DeepSeek-V3.2 and GLM-5: each token's c latent
// values as OCP E4M3 codes in tiles of 128, each tile with its own float32 scale (the tile's
// largest magnitude / 448, so the largest value lands on E4M3's largest), the codes first and the
// tile scales after them in one row of KvFp8RowBytes(c) bytes, zero-padded to a multiple of 16
// (so the CUDA decode kernel moves rows in 16-byte copies; 512 values need no padding). The rope
// key is kept in BF16 beside it (a rounded rope key moves every score of the token). A row is a
// quarter of an F32 row and about half a BF16 one: 528 + 128 bytes against 1152 per token at
// DeepSeek-V3's 512 + 64.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/dtype.h"  // NQ_HOST_DEVICE: the CUDA kernels size rows with the same functions

namespace nq::kernels {

inline constexpr std::int64_t kKvFp8Tile = 128;

NQ_HOST_DEVICE constexpr std::int64_t KvFp8Tiles(std::int64_t c) { return (c + kKvFp8Tile - 1) / kKvFp8Tile; }
inline constexpr std::int64_t kKvFp8RowAlign = 16;
// Bytes of one packed row of c latent values: the codes, the tile scales, the padding.
NQ_HOST_DEVICE constexpr std::int64_t KvFp8RowBytes(std::int64_t c) {
  const std::int64_t used = c + static_cast<std::int64_t>(sizeof(float)) * KvFp8Tiles(c);
  return (used + kKvFp8RowAlign - 1) / kKvFp8RowAlign * kKvFp8RowAlign;
}

// Packs x[0, c) into `row` (KvFp8RowBytes(c) bytes, the padding zeroed): per tile, scale = max |x| / 448 (0 for an
// all-zero tile) and codes E4M3(x / scale), rounded to nearest even (kernels/fp8_block_quantize.h);
// a NaN value gives a NaN code and makes its tile's values NaN when unpacked.
void PackKvFp8Row(const float* x, std::int64_t c, std::uint8_t* row);
// x[i] = E4M3 value of code i times its tile's scale.
void UnpackKvFp8Row(const std::uint8_t* row, std::int64_t c, float* x);

}  // namespace nq::kernels
