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
//     four fp16 pairs (2i, 2i + 1);
//   - Nvfp4WordFragments makes the pairs and the 8 inputs [8q, 8q + 8) of the lane's token into
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

// E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as the high byte of their fp16 encoding (the low
// byte is 0 for all eight): byte tables that prmt indexes with a 3-bit magnitude code.
inline constexpr std::uint32_t kE2M1HighBytesLo = 0x3E3C3800u;  // codes 0..3
inline constexpr std::uint32_t kE2M1HighBytesHi = 0x46444240u;  // codes 4..7
// prmt selectors spreading bytes 0, 1 (or 2, 3) of a register into the high bytes of a half2,
// zeros (selector 4: the zero second operand) in the low bytes.
inline constexpr std::uint32_t kSpread01 = 0x1404u;
inline constexpr std::uint32_t kSpread23 = 0x3424u;
// Sign table: every byte 0x80. A selector nibble with bit 3 set (a negative E2M1 code) reads it in
// prmt's sign-replicate mode, giving 0xFF; a positive code reads it as is, 0x80. Bit 6 of the
// result byte is therefore the code's sign (bit 7 is set either way, so it cannot be used).
inline constexpr std::uint32_t kSignTable = 0x80808080u;
inline constexpr std::uint32_t kByteTopBits = 0x80808080u;

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

// Eight E2M1 codes (element 2i in the low nibble of byte i, ModelOpt's order) -> four fp16 pairs
// as half2 bit patterns: h[i] holds elements 2i (low half) and 2i + 1 (high half). Exact.
NQ_HOST_DEVICE void DecodeE2M1Word(std::uint32_t w, std::uint32_t (&h)[4]) {
  const std::uint32_t m = w & 0x77777777u;
  // Byte i of mag_lo is element i's magnitude (elements 0-3), of mag_hi element 4 + i's.
  const std::uint32_t mag_lo = Prmt(kE2M1HighBytesLo, kE2M1HighBytesHi, m);
  const std::uint32_t mag_hi = Prmt(kE2M1HighBytesLo, kE2M1HighBytesHi, m >> 16);
  // Same byte order; bit 6 of each byte is the element's sign (kSignTable), moved to bit 7.
  const std::uint32_t sign_lo = Prmt(kSignTable, kSignTable, w) << 1;
  const std::uint32_t sign_hi = Prmt(kSignTable, kSignTable, w >> 16) << 1;
  const std::uint32_t b_lo = mag_lo | (sign_lo & kByteTopBits);
  const std::uint32_t b_hi = mag_hi | (sign_hi & kByteTopBits);
  h[0] = Prmt(b_lo, 0u, kSpread01);
  h[1] = Prmt(b_lo, 0u, kSpread23);
  h[2] = Prmt(b_hi, 0u, kSpread01);
  h[3] = Prmt(b_hi, 0u, kSpread23);
}

// First column of the 32 a lane of quad position `quad_lane` reads in warp step `step`.
NQ_HOST_DEVICE int LaneColumn(int step, int quad_lane) { return step * kStepCols + quad_lane * kLaneCols; }

// Which of the lane's two blocks (its two E4M3 scales) word q of its 16 code bytes lies in.
NQ_HOST_DEVICE int WordBlock(int q) { return q / 2; }

// The operands of the lane's two m16n8k16 MMAs for word q, from its scaled pairs of rows g (lo)
// and g + 8 (hi) and its token's 8 inputs of the same columns (x: four half2, pair p = inputs
// 2p, 2p + 1). The PTX fragment layout: A register r of lane (g, t) holds row g + 8 (r & 1), k
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
