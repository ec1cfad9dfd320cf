// trellis_v1's decode (issue #16): from a tile's packed bits to the unit value of one weight.
// Plain C++20 and CUDA (nvcc) alike: every function is constexpr and, under nvcc,
// __host__ __device__, so the GPU MoE kernels include this header and decode exactly what
// the CPU codec (trellis_codec.h) decodes.
//
// ---- The trellis ---------------------------------------------------------------------
// A bitshift trellis with L = 16 state bits and K bits per weight (K = 2 for both planes).
// A sequence is one 16 x 16 tile of the rotated, scaled matrix: 256 weights, weight t =
// 16 * r + c for tile row r and tile column c (row-major inside the tile). Symbol c_t (K
// bits) enters the state at the top:
//   s_t = (s_{t-1} >> K) | (c_t << (16 - K))
// so s_t holds c_t in its top K bits and c_{t-16/K+1} in its bottom K bits. Tail-biting: the
// sequence is a ring (s_{-1} = s_255), so a tile's 256 symbols are its whole code (no
// start state is stored) and 2-bit tiles cost exactly 2 bits per weight.
//
// ---- Plane layout (base and residual planes alike, K = 2) ------------------------------
// Tiles are ordered row-major over the tile grid: tile (ti, tj) of a rows x cols matrix
// (both multiples of 16) is tile ti * (cols / 16) + tj and occupies bytes [64 * tile,
// 64 * tile + 64) of the plane. Inside a tile, symbol t sits at bits [2t, 2t + 2) of the
// tile's 512-bit little-endian string (byte t / 4, bit 2 * (t % 4): the same packing as
// codec.h's PackCodes, in tile order instead of row-major order). Read as sixteen
// little-endian uint32 words w[0..15], the state of weight t is the 16 bits of the ring
// that end with symbol t:
//   s_t = bits [2t - 14, 2t + 2) of the ring, i.e. start bit p = (2t - 14) mod 512,
//   s_t = ((w[p / 32] | (uint64)w[(p / 32 + 1) % 16] << 32) >> (p % 32)) & 0xFFFF.
// The bottom bits are the oldest symbol, so this is exactly the shift-register state above.
//
// ---- Value -----------------------------------------------------------------------------
// The codebook is computed, not stored: one 32-bit multiply-add of the state, then the sum
// of the four bytes of the product (a sum of four near-uniform bytes is near-Gaussian:
// mean 510, standard deviation sqrt(4 * (256^2 - 1) / 12) = 147.80), centred and scaled to
// unit variance. Per weight that is: one funnel shift and mask (state), one IMAD, two ANDs,
// one shift and two adds (byte sum; on CUDA one __vsadu4 or __dp4a can replace them), one
// int-to-float and one FMA. The weight is then
//   w'[i][j] = row_scale[i] * col_scale[j] * (base_gain * U(s_base) + residual_gain * U(s_res))
// in the rotated domain (the residual term only at 4 bits), followed by the inverse rotation.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NQ_TRELLIS_FN __host__ __device__ __forceinline__ constexpr
#else
#define NQ_TRELLIS_FN inline constexpr
#endif

namespace nq::quant::trellis {

// Trellis geometry (issue #16: L = 16, 2 bits per weight, 256-weight tail-biting tiles).
inline constexpr int kStateBits = 16;
inline constexpr uint32_t kStateCount = 1u << kStateBits;
inline constexpr uint32_t kStateMask = kStateCount - 1u;
inline constexpr int kSymbolBits = 2;
inline constexpr int kTileDim = 16;
inline constexpr int kTileWeights = kTileDim * kTileDim;                // 256
inline constexpr int kTileBits = kTileWeights * kSymbolBits;            // 512
inline constexpr int kTileBytes = kTileBits / 8;                        // 64
inline constexpr int kTileWords = kTileBits / 32;                       // 16
// Symbols a state spans; the state of weight t starts (16 - 2) bits before symbol t.
inline constexpr int kStateSpan = kStateBits / kSymbolBits;              // 8

// The hash: a full-period 32-bit multiply-add (odd multiplier; both constants chosen here by
// measuring trellis MSE on N(0,1) over a handful of candidates, see trellis_codec.cc).
inline constexpr uint32_t kHashMul = 0x2C9277B5u;
inline constexpr uint32_t kHashAdd = 0x9E3779B9u;
// Byte-sum statistics of a uniform 32-bit word: mean 4 * 127.5, sd sqrt(4 * (256^2-1) / 12).
inline constexpr float kByteSumMean = 510.0f;
inline constexpr float kInvByteSumSd = 1.0f / 147.8005f;

// The unit-variance codebook value of a 16-bit state.
NQ_TRELLIS_FN float UnitValue(uint32_t state) {
  const uint32_t x = (state & kStateMask) * kHashMul + kHashAdd;
  const uint32_t pairs = (x & 0x00FF00FFu) + ((x >> 8) & 0x00FF00FFu);
  const uint32_t sum = (pairs & 0xFFFFu) + (pairs >> 16);
  return (static_cast<float>(sum) - kByteSumMean) * kInvByteSumSd;
}

// The state of weight t (0..255) of a tile given as sixteen little-endian uint32 words.
NQ_TRELLIS_FN uint32_t TileState(const uint32_t* words, int t) {
  const int p = (kSymbolBits * t - (kStateBits - kSymbolBits) + kTileBits) % kTileBits;
  const int w = p / 32;
  const uint64_t pair =
      static_cast<uint64_t>(words[w]) | (static_cast<uint64_t>(words[(w + 1) % kTileWords]) << 32);
  return static_cast<uint32_t>(pair >> (p % 32)) & kStateMask;
}

// The same from the tile's 64 bytes (host code, or a device copy that is not word-aligned).
NQ_TRELLIS_FN uint32_t TileStateFromBytes(const uint8_t* bytes, int t) {
  uint32_t state = 0;
  for (int k = 0; k < kStateSpan; ++k) {
    const int sym = (t - (kStateSpan - 1) + k + kTileWeights) % kTileWeights;
    const uint32_t c = (bytes[sym / 4] >> (kSymbolBits * (sym % 4))) & 0x3u;
    state |= c << (kSymbolBits * k);
  }
  return state;
}

// Byte offset of tile (ti, tj) in a plane of a matrix with `cols` columns.
NQ_TRELLIS_FN int64_t TileByteOffset(int64_t ti, int64_t tj, int64_t cols) {
  return (ti * (cols / kTileDim) + tj) * kTileBytes;
}

}  // namespace nq::quant::trellis

#undef NQ_TRELLIS_FN
