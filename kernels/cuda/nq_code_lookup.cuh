// Dequantising nested_scalar_v1 code words in registers (kernels/nq_moe.h states the codes).
//
// A 32-bit word holds 16 two-bit codes (code i at bits 2i). A word decodes to eight half2 weight
// pairs in "pair order": pair p holds codes (p, p + 8), the codes at the same place of the word's
// two 16-bit halves; callers lay the activations out in the same order (PairSlot) so no shuffle
// is ever needed. Two decodes:
//   - Even base grid (levels s * (b - 1.5), quant::BaseGrid::kUniform, what nq encode writes by
//     default): one lop3 per pair turns the codes at bits 2j..2j+1 of both halves into the
//     subnormal fp16 pair code * 4^j * 2^-24; the inputs carry the 4^-j, the GEMV the offset
//     1.5 and the step s (DecodeWord2EvenGrid).
//   - Any table (and always at 4 bits): the codes (or the 4-bit indices 4 * base + residual of a
//     word pair) are gathered into byte-permute selectors and looked up in the matrix's fp16
//     level table held in registers (PTX prmt). Bound by the SM's logic pipe (prmt, shifts,
//     masks: half the rate of fp32), so the 2-bit lookup builds its selectors with integer
//     multiply-adds (another pipe).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace nq::kernels::cuda {

inline constexpr int kCodesPerWord = 16;                 // 2-bit codes in a 32-bit word
inline constexpr int kPairsPerWord = kCodesPerWord / 2;  // half2 weight pairs per word

// PTX prmt in its default mode: byte n of the result is byte (s.nibble[n] & 7) of {b:a}, or that
// byte's sign replicated when the nibble's bit 3 is set (the 4-bit lookup uses both).
__device__ __forceinline__ std::uint32_t Prmt(std::uint32_t a, std::uint32_t b, std::uint32_t s) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}

// Low and high bytes of fp16 level values, byte i = entry i.
struct LevelBytes2 {
  std::uint32_t lo = 0, hi = 0;  // the 4 base levels
};
struct LevelBytes4 {
  std::uint32_t lo[4] = {}, hi[4] = {};  // the 16 4-bit levels, 4 per register
};

__device__ __forceinline__ void PackLevelBytes(const float* levels, int n, std::uint32_t* lo, std::uint32_t* hi) {
  for (int r = 0; r < n / 4; ++r) {
    lo[r] = 0;
    hi[r] = 0;
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t bits = __half_as_ushort(__float2half_rn(levels[4 * r + i]));
      lo[r] |= static_cast<std::uint32_t>(bits & 0xff) << (8 * i);
      hi[r] |= static_cast<std::uint32_t>(bits >> 8) << (8 * i);
    }
  }
}

// Two half2 weight pairs from the low and high bytes of four looked-up levels (bytes 0..3 for
// indices n0..n3): (n0, n2) and (n1, n3), the pair order's pairing of codes four apart.
__device__ __forceinline__ void Interleave(std::uint32_t lo, std::uint32_t hi, __half2& p02, __half2& p13) {
  const std::uint32_t a = Prmt(lo, hi, 0x6240), b = Prmt(lo, hi, 0x7351);
  p02 = *reinterpret_cast<const __half2*>(&a);
  p13 = *reinterpret_cast<const __half2*>(&b);
}

// One half2 straight from the 4-entry table: the selector's nibbles are (c, c + 4, c', c' + 4),
// so prmt takes the low and the high byte of L[c] and of L[c'] in one instruction.
__device__ __forceinline__ __half2 Pair2(const LevelBytes2& t, std::uint32_t selector) {
  const std::uint32_t v = Prmt(t.lo, t.hi, selector);
  return *reinterpret_cast<const __half2*>(&v);
}

// Selectors from e, which holds one 2-bit code in bits 0-1 of each byte: e * 0x11 copies each
// code into both nibbles of its byte and + 0x40 makes the upper one c + 4 (an integer
// multiply-add, which runs beside the prmts rather than in the same logic pipe). prmt reads the
// low 16 bits: bytes 0-1 as they are, bytes 2-3 after a shift.
__device__ __forceinline__ std::uint32_t Selectors(std::uint32_t e) { return e * 0x11u + 0x40404040u; }

// s holds four 4-bit indices (0..15): bits 0-2 pick among 8 entries, bit 3 picks the half.
__device__ __forceinline__ void Lookup4(const LevelBytes4& t, std::uint32_t s, __half2& p02, __half2& p13) {
  const std::uint32_t s7 = s & 0x7777u;
  const std::uint32_t high = s & 0x8888u;
  // 0xFF bytes where the index is >= 8: nibble 0xC replicates the sign of byte 4 (0x80).
  const std::uint32_t mask = Prmt(0u, 0x80u, high | (high >> 1));
  const std::uint32_t lo = (Prmt(t.lo[2], t.lo[3], s7) & mask) | (Prmt(t.lo[0], t.lo[1], s7) & ~mask);
  const std::uint32_t hi = (Prmt(t.hi[2], t.hi[3], s7) & mask) | (Prmt(t.hi[0], t.hi[1], s7) & ~mask);
  Interleave(lo, hi, p02, p13);
}

// The eight weight pairs of one word of 2-bit codes, in pair order, by table lookup: 9 prmt, 11
// shifts and masks (logic pipe), 4 multiply-adds.
__device__ __forceinline__ void DecodeWord2(const LevelBytes2& t, std::uint32_t base, __half2 (&w)[kPairsPerWord]) {
  // Bytes 1 and 2 swapped, so byte n of the masked word below holds codes k, k + 8, k + 4, k + 12.
  const std::uint32_t swapped = Prmt(base, 0u, 0x3120u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const std::uint32_t s = Selectors((swapped >> (2 * k)) & 0x03030303u);
    w[k] = Pair2(t, s);            // codes k, k + 8
    w[k + 4] = Pair2(t, s >> 16);  // codes k + 4, k + 12
  }
}

// The even-grid decode puts the code pair at bits 2j..2j+1 of both halves of a register and
// reads it, masked, as an fp16 pair with a zero exponent field: a subnormal, code * 4^j * 2^-24,
// exact, one lop3 per pair and nothing else. The tensor cores multiply subnormal fp16 exactly, so
// the GEMV feeds these straight into its MMAs against inputs stored times 4^-j (the prepared
// vector's even-grid plane) and recovers sum (code - 1.5) * x from 2^24 times the result minus
// 1.5 * sum x, the input's sum (kernels/cuda/nq_moe_gemv.cu). j is pair p's position below.
__host__ __device__ __forceinline__ constexpr int EvenGridShift(int pair) {
  return pair == 0 ? 1 : pair <= 4 ? pair : pair - 4;
}
inline constexpr float kEvenGridUnit = 5.9604644775390625e-08f;  // 2^-24, fp16's subnormal step

template <int kJ>
__device__ __forceinline__ __half2 EvenGridPair(std::uint32_t v) {
  static_assert(kJ >= 1 && kJ <= 4, "code position outside the mantissa");
  const std::uint32_t h = v & (0x00030003u << (2 * kJ));
  return *reinterpret_cast<const __half2*>(&h);
}

// The eight weight pairs of one word of 2-bit codes on the even grid, as code * 4^j * 2^-24 (j =
// EvenGridShift(pair)): 2 shifts and 8 lop3, no lookups and no arithmetic.
__device__ __forceinline__ void DecodeWord2EvenGrid(std::uint32_t base, __half2 (&w)[kPairsPerWord]) {
  const std::uint32_t up = base << 2;    // codes 0 and 8 at bits 2 and 18
  const std::uint32_t down = base >> 8;  // codes 5..7 and 13..15 at bits 2..7 and 18..23
  static_assert(EvenGridShift(0) == 1 && EvenGridShift(4) == 4 && EvenGridShift(7) == 3);
  w[0] = EvenGridPair<1>(up);
  w[1] = EvenGridPair<1>(base);
  w[2] = EvenGridPair<2>(base);
  w[3] = EvenGridPair<3>(base);
  w[4] = EvenGridPair<4>(base);
  w[5] = EvenGridPair<1>(down);
  w[6] = EvenGridPair<2>(down);
  w[7] = EvenGridPair<3>(down);
}

// The even grid's step when a matrix's base levels are exactly s * (-1.5, -0.5, 0.5, 1.5) in
// float (what quant::BaseGrid::kUniform writes), else 0: the table decode must run. The GEMV
// then multiplies the exact code - 1.5 by s in fp32, where the CPU decoder uses its float level
// s * (b - 1.5): the same weight.
__host__ __device__ __forceinline__ float EvenGridStep(const float* base_levels) {
  const float s = base_levels[3] - base_levels[2];
  const bool even = s > 0.0f && s < 3.0e38f && base_levels[0] == -1.5f * s && base_levels[1] == -0.5f * s &&
                    base_levels[2] == 0.5f * s && base_levels[3] == 1.5f * s;
  return even ? s : 0.0f;
}

// The step s of uniform nested levels (quant::BaseGrid::kUniformNested): base levels on the even
// grid s * (b - 1.5) and all sixteen 4-bit levels on the even grid nested in it, s / 4 *
// (4 b + r - 7.5), exactly in float (s has 7 significant bits, so every level is an fp16 value);
// else 0, and 4-bit experts take the table decode.
__host__ __device__ __forceinline__ float UniformNestedStep(const float* base_levels, const float* levels4) {
  const float s = EvenGridStep(base_levels);
  if (s == 0.0f) return 0.0f;
  for (int k = 0; k < 16; ++k) {
    if (levels4[k] != 0.25f * (s * (static_cast<float>(k) - 7.5f))) return 0.0f;
  }
  return s;
}

__device__ __forceinline__ __half2 HalfPairBits(std::uint32_t v) { return *reinterpret_cast<const __half2*>(&v); }

// The eight weight pairs of a base word and its residual word on uniform nested levels, as
// (4 b + r) * 4^(j - 1) * 2^-24 with j = EvenGridShift(pair): the 4-bit codes of the even and of
// the odd positions are assembled as nibbles (two shifts, two lop3), and each pair is masked out
// of them where the even-grid plane's 4^-j expects it (three shifts, eight lop3), so the inputs of
// the 2-bit even grid serve unchanged and the GEMV subtracts 7.5 / 4 of their sum where the base
// subtracts 1.5. A quarter of the table decode's instructions.
__device__ __forceinline__ void DecodeWord4UniformNested(std::uint32_t base, std::uint32_t residual,
                                                         __half2 (&w)[kPairsPerWord]) {
  // Nibble n of `even` is 4 b + r of code 2n; of `odd`, of code 2n + 1.
  const std::uint32_t even = ((base << 2) & 0xccccccccu) | (residual & 0x33333333u);
  const std::uint32_t odd = (base & 0xccccccccu) | ((residual >> 2) & 0x33333333u);
  const std::uint32_t even2 = even >> 2, even10 = even >> 10, odd8 = odd >> 8;
  static_assert(EvenGridShift(0) == 1 && EvenGridShift(2) == 2 && EvenGridShift(3) == 3 && EvenGridShift(4) == 4 &&
                EvenGridShift(5) == 1 && EvenGridShift(6) == 2 && EvenGridShift(7) == 3);
  w[0] = HalfPairBits(even & 0x000f000fu);    // codes 0, 8 at bit 0
  w[1] = HalfPairBits(odd & 0x000f000fu);     // 1, 9 at bit 0
  w[2] = HalfPairBits(even2 & 0x003c003cu);   // 2, 10 at bit 2
  w[3] = HalfPairBits(odd & 0x00f000f0u);     // 3, 11 at bit 4
  w[4] = HalfPairBits(even2 & 0x03c003c0u);   // 4, 12 at bit 6
  w[5] = HalfPairBits(odd8 & 0x000f000fu);    // 5, 13 at bit 0
  w[6] = HalfPairBits(even10 & 0x003c003cu);  // 6, 14 at bit 2
  w[7] = HalfPairBits(odd8 & 0x00f000f0u);    // 7, 15 at bit 4
}

// The same at 4 bits from a base word and its residual word.
__device__ __forceinline__ void DecodeWord4(const LevelBytes4& t, std::uint32_t base, std::uint32_t residual,
                                            __half2 (&w)[kPairsPerWord]) {
  // Nibble n of `even` is 4 * b[2n] + r[2n]; of `odd`, 4 * b[2n+1] + r[2n+1].
  const std::uint32_t even = ((base << 2) & 0xccccccccu) | (residual & 0x33333333u);
  const std::uint32_t odd = (base & 0xccccccccu) | ((residual >> 2) & 0x33333333u);
  // Bytes 0 and 2 (nibbles of codes 0, 2, 8, 10 or 1, 3, 9, 11), then bytes 1 and 3: Lookup4
  // pairs its first and third, second and fourth indices.
  Lookup4(t, Prmt(even, 0u, 0x20u), w[0], w[2]);  // codes (0, 8), (2, 10)
  Lookup4(t, Prmt(even, 0u, 0x31u), w[4], w[6]);  // (4, 12), (6, 14)
  Lookup4(t, Prmt(odd, 0u, 0x20u), w[1], w[3]);   // (1, 9), (3, 11)
  Lookup4(t, Prmt(odd, 0u, 0x31u), w[5], w[7]);   // (5, 13), (7, 15)
}

// Position of code i (0..15) of a word in pair order: 2 * pair + half.
__host__ __device__ __forceinline__ int PairSlot(int i) { return 2 * (i & 7) + (i >> 3); }

}  // namespace nq::kernels::cuda
