// Dequantising nested_scalar_v1 code words in registers (kernels/nq_moe.h states the codes).
//
// A 32-bit word holds 16 two-bit codes (code i at bits 2i). Its codes (or the 4-bit indices
// 4 * base + residual of a word pair) are gathered into byte-permute selectors and looked up in
// the matrix's fp16 level table held in registers (PTX prmt), giving half2 weight pairs. A word
// decodes to eight pairs in "pair order": (0,4) (1,5) (2,6) (3,7) (8,12) (9,13) (10,14) (11,15);
// callers lay the activations out in the same order (PairSlot) so no shuffle is ever needed.
// The decode is bound by the SM's logic pipe (prmt, shifts, masks: half the rate of fp32), so
// the 2-bit path builds its selectors with integer multiply-adds instead (another pipe).
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

// Pair order: pair p < 4 holds codes (p, p + 4), pair p >= 4 codes (p + 4, p + 8).

// The eight weight pairs of one word of 2-bit codes, in pair order: 8 prmt, 11 shifts and masks
// (logic pipe), 4 multiply-adds.
__device__ __forceinline__ void DecodeWord2(const LevelBytes2& t, std::uint32_t base, __half2 (&w)[kPairsPerWord]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const std::uint32_t s = Selectors((base >> (2 * k)) & 0x03030303u);  // codes k, k + 4, k + 8, k + 12
    w[k] = Pair2(t, s);
    w[k + 4] = Pair2(t, s >> 16);
  }
}

// The same at 4 bits from a base word and its residual word.
__device__ __forceinline__ void DecodeWord4(const LevelBytes4& t, std::uint32_t base, std::uint32_t residual,
                                            __half2 (&w)[kPairsPerWord]) {
  // Nibble n of `even` is 4 * b[2n] + r[2n]; of `odd`, 4 * b[2n+1] + r[2n+1].
  const std::uint32_t even = ((base << 2) & 0xccccccccu) | (residual & 0x33333333u);
  const std::uint32_t odd = (base & 0xccccccccu) | ((residual >> 2) & 0x33333333u);
  Lookup4(t, even, w[0], w[2]);        // codes (0, 4), (2, 6)
  Lookup4(t, even >> 16, w[4], w[6]);  // (8, 12), (10, 14)
  Lookup4(t, odd, w[1], w[3]);         // (1, 5), (3, 7)
  Lookup4(t, odd >> 16, w[5], w[7]);   // (9, 13), (11, 15)
}

// Position of code i (0..15) of a word in pair order: 2 * pair + half.
__host__ __device__ __forceinline__ int PairSlot(int i) {
  const int pair = (i & 3) + 4 * (i >> 3);
  const int half = (i >> 2) & 1;
  return 2 * pair + half;
}

}  // namespace nq::kernels::cuda
