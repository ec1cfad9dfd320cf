// trellis_v1 tiles on the GPU (issue #12): from a 16 x 16 tile's sixteen uint32 words
// (services/quant/trellis_decode.h: the layout, the state of weight t = 16 r + c, the computed
// codebook) to fp16 weights for mma.sync, decoding exactly what TrellisCodec::Decode decodes.
//
// ---- The exact fp16 form ----------------------------------------------------------------
// The codebook value of a state is U(s) = (S - 510) / 147.8005, S the byte sum in [0, 1020] of
// the hashed state. The kernels never form U: they produce the integer S - 510 exactly in fp16
// and leave 1/147.8005 (kInvByteSumSd) and the per-16-column-block gains to the caller, who folds
// them into the activations (per column block) or the epilogue. Integers up to 2048 are exact in
// fp16, and so is this road to them:
//   bits 0x6400 | S  is the fp16 number 1024 + S (exponent 2^10, S in the 10-bit significand,
//                    exact because S < 1024);
//   (1024 + S) - 1534 = S - 510 in [-510, 510], an integer, so the fp16 subtraction is exact.
// One integer OR per weight pair and one HSUB2, instead of an int-to-float conversion, a multiply
// and a float-to-half rounding per weight. A 4-bit tile is two MMAs on the same activations: the
// base fragment against x * gain_base and the residual fragment against x * gain_res.
//
// ---- States by funnel shift ------------------------------------------------------------------
// The state of weight t is the 16 ring bits starting at p = (2t - 14) mod 512, which straddle at
// most two consecutive words. __funnelshift_r(lo, hi, n) returns the low 32 bits of
// (hi:lo) >> (n & 31) in one SHF instruction, with no 64-bit shift and no branch on whether the
// bits cross the word boundary. One funnel shift gives 32 ring bits, i.e. the states of 9
// consecutive weights (each 2 bits further); a fragment's weight pairs (t, t + 1) share one.
//
// ---- mma.sync.m16n8k16 A fragment (row-major A, fp16) -----------------------------------------
// Lane = 4 g + j (g = lane / 4 in 0..7, j = lane % 4) holds
//   a0 = (row g,     cols 2j, 2j + 1)      a1 = (row g + 8, cols 2j, 2j + 1)
//   a2 = (row g,     cols 2j + 8, 2j + 9)  a3 = (row g + 8, cols 2j + 8, 2j + 9)
// (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), the low half the
// smaller column. With the tile's rows as A's rows (16 weight rows) and its columns as K (16
// inputs of one column block), one tile is exactly one A operand, and its column block has one
// gain: the caller scales the B operand (activations) by gain / 147.8005 per column block.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "services/quant/trellis_decode.h"

namespace nq::kernels::cuda::trellis {

using quant::trellis::kHashAdd;
using quant::trellis::kHashMul;
using quant::trellis::kInvByteSumSd;
using quant::trellis::kStateMask;
using quant::trellis::kTileDim;
using quant::trellis::kTileWords;

// fp16 bit pattern of 1024.0 (sign 0, biased exponent 25 = 10 + 15, significand 0) in both
// halves of a word; OR-ing S < 1024 into a half's significand gives 1024 + S exactly.
inline constexpr std::uint32_t kHalf1024Pair = 0x64006400u;
// 1024 + the byte sum's mean 510: subtracting it leaves S - 510.
inline constexpr float kByteSumBias = 1534.0f;

// The byte sum S in [0, 1020] of a state's hash (trellis_decode.h's UnitValue before centring):
// one IMAD and one DP4A against 0x01010101 (four unsigned byte products with 1, summed).
__device__ __forceinline__ std::uint32_t ByteSum(std::uint32_t state) {
  const std::uint32_t x = (state & kStateMask) * kHashMul + kHashAdd;
  return __dp4a(x, 0x01010101u, 0u);
}

// Two byte sums as the __half2 (s_lo - 510, s_hi - 510), exact (see the header comment).
__device__ __forceinline__ __half2 CentredPair(std::uint32_t sum_lo, std::uint32_t sum_hi) {
  const std::uint32_t bits = kHalf1024Pair | sum_lo | (sum_hi << 16);
  const __half2 biased = *reinterpret_cast<const __half2*>(&bits);
  return __hsub2(biased, __float2half2_rn(kByteSumBias));
}

// 32 ring bits starting at ring bit p (0 <= p < 512) of a tile's words: the state of the weight
// whose state starts at p is the low 16 bits, the next weight's is 2 bits further.
__device__ __forceinline__ std::uint32_t RingBits(const std::uint32_t* words, int p) {
  const int w = p >> 5;
  return __funnelshift_r(words[w], words[(w + 1) & (kTileWords - 1)], static_cast<unsigned>(p & 31));
}

// Ring bit where the state of weight (r, c) starts: 2 t - 14 mod 512, t = 16 r + c.
__device__ __forceinline__ int StateStart(int r, int c) {
  return (2 * (kTileDim * r + c) - 14) & (quant::trellis::kTileBits - 1);
}

// The centred integer S - 510 of weight (r, c) of a tile, exact in fp16: for dequantisation
// kernels that place single weights. Multiply by kInvByteSumSd (and the gain) for U.
__device__ __forceinline__ __half CentredWeight(const std::uint32_t* words, int r, int c) {
  const std::uint32_t sum = ByteSum(RingBits(words, StateStart(r, c)));
  return __low2half(CentredPair(sum, 0u));
}

// The same as an int, for callers that accumulate in integers or test against the host.
__device__ __forceinline__ int CentredWeightInt(const std::uint32_t* words, int r, int c) {
  return static_cast<int>(ByteSum(RingBits(words, StateStart(r, c)))) - 510;
}

// Weights (r, c) and (r, c + 1) as one __half2 (low half c): one funnel shift serves both.
__device__ __forceinline__ __half2 CentredWeightPair(const std::uint32_t* words, int r, int c) {
  const std::uint32_t bits = RingBits(words, StateStart(r, c));
  return CentredPair(ByteSum(bits), ByteSum(bits >> 2));
}

// The calling lane's A fragment of mma.sync.m16n8k16 (row-major A = the tile, fp16) with every
// weight S - 510: a[0..3] as in the header comment. `words` may be registers indexed by
// constants, shared or global memory (16 consecutive uint32, the tile's 64 bytes).
__device__ __forceinline__ void TileAFragment(const std::uint32_t* words, int lane, __half2 (&a)[4]) {
  const int g = lane >> 2, j = lane & 3;
  a[0] = CentredWeightPair(words, g, 2 * j);
  a[1] = CentredWeightPair(words, g + 8, 2 * j);
  a[2] = CentredWeightPair(words, g, 2 * j + 8);
  a[3] = CentredWeightPair(words, g + 8, 2 * j + 8);
}

// One whole tile row r as eight __half2 (columns 2i, 2i + 1 in out[i]), S - 510 each. Row r's
// states lie in ring bits [32 r - 14, 32 r + 32): words r - 1 and r only, passed as `prev` and
// `cur`, so a dequantiser loads 8 bytes per row and plane.
__device__ __forceinline__ void TileRow(std::uint32_t prev, std::uint32_t cur, __half2 (&out)[8]) {
  // Columns 0..6 start in `prev` at bit 18 + 2c; column 7 starts at bit 32 (= cur at 0) and
  // columns 8..15 inside `cur` at 2c - 14 <= 16, so their 16 bits never leave `cur`.
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = 2 * i;
    const std::uint32_t lo = c < 7 ? __funnelshift_r(prev, cur, 18 + c * 2) : cur >> (c * 2 - 14);
    const std::uint32_t hi = c + 1 < 7 ? __funnelshift_r(prev, cur, 18 + (c + 1) * 2) : cur >> ((c + 1) * 2 - 14);
    out[i] = CentredPair(ByteSum(lo), ByteSum(hi));
  }
}

}  // namespace nq::kernels::cuda::trellis
