// The register-level pieces of the NVFP4 GEMV (nvfp4_gemv.cu) that decide its correctness, as
// host/device functions: the kernel runs them, and a host emulation of the kernel's warp step
// (tests/kernels/cpu/nvfp4_fragment_test.cc) runs the same code against the CPU reference, so
// the emulation checks what the GPU executes rather than a second copy of it. Only the MMA
// itself and the E4M3 pair conversion are emulated from the PTX ISA's definitions there.
//
// A lane's view of one warp step (128 columns of a 16-row tile):
//   - it reads 16 code bytes (32 elements: two 16-element blocks) of rows g and g + 8, g = lane / 4,
//     at columns Nvfp4LaneColumn(step, lane % 4) and following, and the two E4M3 scales of those
//     blocks;
//   - word q of the 16 bytes is elements [8q, 8q + 8) of that chunk; DecodeE2M1Word turns it into
//     four fp16 pairs (elements PairElement(i, 0), PairElement(i, 1)), each value times 2^-14;
//   - Nvfp4WordFragments makes the pairs, scaled, and the 8 inputs [8q, 8q + 8) of the lane's token
//     (stored in the pairs' order, Nvfp4InputPosition) into
//     the operands of two m16n8k16 MMAs. The 16 k indices of one MMA come from 4 lanes' different
//     chunks, which is fine because both operands use the same k -> column map (the block scale
//     is applied to each weight before the MMA, so the k order is free).
// No absl or CUDA header: host code includes this.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace nq::kernels::nvfp4 {

// Columns one lane reads per step: 16 code bytes, two NVFP4 blocks.
inline constexpr int kLaneCols = 32;
// Columns of one warp step: the four lanes of a quad side by side.
inline constexpr int kStepCols = 4 * kLaneCols;

// The decode is shifts and masks, no lookup: an E2M1 code s|e1 e0|m is an fp16 whose high byte is
// s000 e1 e0 m 0 and low byte 0, read as the code's value times 2^-14 (e1 e0 lands in the two low
// exponent bits and m in the top mantissa bit, so e = 0 gives the subnormal 0 or 0.5 * 2^-14 and
// e > 0 gives 2^(e - 1) (1 + m / 2) * 2^-14: exact for all 16 codes). The block scale, times 2^7
// (kScaleBias below), multiplies it; the row's sum is multiplied by 2^7 at the end.
//
// The high bytes of the word's eight elements are built in two registers, then spread into the
// high bytes of four half2 with prmt (zeros from the second operand):
//   L byte i = element 2i (byte i's low nibble: magnitude << 1, sign bit 3 -> bit 7)
//   H byte i = element 2i + 1 (byte i's high nibble: magnitude >> 3, sign already at bit 7)
// So the half2s hold elements (0, 2), (4, 6), (1, 3), (5, 7): the input vector is stored with the
// same order inside every aligned group of 8 (Nvfp4InputPosition), so the MMAs' B fragments are
// still one 16-byte load.
inline constexpr std::uint32_t kLowNibbleMagnitude = 0x0E0E0E0Eu;  // after << 1
inline constexpr std::uint32_t kByteSignBits = 0x80808080u;
// prmt selectors spreading bytes 0, 1 (or 2, 3) of a register into the high bytes of a half2,
// zeros (selector 4: the zero second operand) in the low bytes.
inline constexpr std::uint32_t kSpread01 = 0x1404u;
inline constexpr std::uint32_t kSpread23 = 0x3424u;
// The decoded codes are value * 2^-14 and the block scales are applied times 2^kScaleBias: the
// product value * scale * 2^-7 is exact in fp16 for every E2M1 x E4M3 pair (at most 6 significant
// bits, no smaller than 2^-17 > 2^-24, no larger than 2688 * 2^-7 = 21), and 448 * 2^7 = 57344
// fits fp16. The row's fp32 sum is multiplied by 2^kScaleBias.
inline constexpr int kScaleBias = 7;

// PTX prmt.b32 in its default mode: byte i of the result is byte (s >> 4i) & 7 of {b, a} (a holds
// bytes 0-3), or, when bit 3 of that selector nibble is set, that byte's top bit replicated
// through all eight bits. Only the low 16 bits of s are read.
NQ_HOST_DEVICE std::uint32_t Prmt(std::uint32_t a, std::uint32_t b, std::uint32_t s) {
#if defined(__CUDA_ARCH__)
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
#else
  const std::uint64_t bytes = (std::uint64_t{b} << 32) | a;
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t nibble = (s >> (4 * i)) & 0xFu;
    std::uint32_t byte = static_cast<std::uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if ((nibble & 8u) != 0) byte = (byte & 0x80u) != 0 ? 0xFFu : 0x00u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// Which element of the word (0-7) half `half` (0 low, 1 high) of pair i holds.
NQ_HOST_DEVICE int PairElement(int i, int half) { return (i < 2 ? 0 : 1) + 4 * (i % 2) + 2 * half; }

// Where element e of an aligned group of 8 inputs is stored: the order the pairs take,
// 0 2 4 6 1 3 5 7 (pair i's two elements adjacent, pairs in order).
NQ_HOST_DEVICE int Nvfp4InputPosition(int e) { return (e % 2 == 0 ? 0 : 4) + e / 2; }

// Eight E2M1 codes (element 2i in the low nibble of byte i, ModelOpt's order) -> four fp16 pairs
// as half2 bit patterns, each the code's value times 2^-14: h[i] holds elements PairElement(i, 0)
// (low half) and PairElement(i, 1) (high half). Exact. 11 integer instructions.
NQ_HOST_DEVICE void DecodeE2M1Word(std::uint32_t w, std::uint32_t (&h)[4]) {
  const std::uint32_t lo = ((w << 1) & kLowNibbleMagnitude) | ((w << 4) & kByteSignBits);
  const std::uint32_t hi = ((w >> 3) & kLowNibbleMagnitude) | (w & kByteSignBits);
  h[0] = Prmt(lo, 0u, kSpread01);
  h[1] = Prmt(lo, 0u, kSpread23);
  h[2] = Prmt(hi, 0u, kSpread01);
  h[3] = Prmt(hi, 0u, kSpread23);
}

// First column of the 32 a lane of quad position `quad_lane` reads in warp step `step`.
NQ_HOST_DEVICE int LaneColumn(int step, int quad_lane) { return step * kStepCols + quad_lane * kLaneCols; }

// Which of the lane's two blocks (its two E4M3 scales) word q of its 16 code bytes lies in.
NQ_HOST_DEVICE int WordBlock(int q) { return q / 2; }

// The operands of the lane's two m16n8k16 MMAs for word q, from its scaled pairs of rows g (lo)
// and g + 8 (hi) and its token's 8 inputs of the same columns (x: four half2, pair p = the
// inputs of elements PairElement(p, 0) and PairElement(p, 1), as Nvfp4InputPosition stores them). The PTX fragment layout: A register r of lane (g, t) holds row g + 8 (r & 1), k
// 2t + 8 (r >> 1) and the next; B register r holds k 2t + 8 r and the next, column g. So MMA 0
// sees pair 0 at k {2t, 2t + 1} and pair 1 at k {2t + 8, 2t + 9} in A and B alike; MMA 1 pairs
// 2 and 3. Every k index of either MMA meets the weight and the input of the same column.
NQ_HOST_DEVICE void WordFragments(const std::uint32_t (&lo)[4], const std::uint32_t (&hi)[4],
                                  const std::uint32_t (&x)[4], std::uint32_t (&a)[2][4], std::uint32_t (&b)[2][2]) {
  for (int m = 0; m < 2; ++m) {
    a[m][0] = lo[2 * m];
    a[m][1] = hi[2 * m];
    a[m][2] = lo[2 * m + 1];
    a[m][3] = hi[2 * m + 1];
    b[m][0] = x[2 * m];
    b[m][1] = x[2 * m + 1];
  }
}

// The accumulator register r of lane (g, t) holds row g + 8 (r >> 1) of the tile, MMA column
// (token) 2t + (r & 1).
NQ_HOST_DEVICE int AccRow(int lane, int r) { return lane / 4 + 8 * (r >> 1); }
NQ_HOST_DEVICE int AccToken(int lane, int r) { return 2 * (lane % 4) + (r & 1); }

}  // namespace nq::kernels::nvfp4
