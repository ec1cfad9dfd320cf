// The GPU decode of nested_scalar_v1 codes (kernels/cuda/nq_code_lookup.cuh) against the level
// tables the CPU decoder uses: every weight's fp16 level must equal the table's float level
// exactly (the codebooks nq encode writes are on the fp16 grid), at 2 and at 4 bits, for every
// code position of a word. The MoE kernels never form rs * level * cs, so this is the
// bit-for-bit half of "dequantised weights equal the CPU decoder's"; the block tests cover the
// rest within tolerance.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/nq_code_lookup.cuh"
#include "kernels/nq_moe.h"
#include "tests/kernels/nq_moe_fixture.h"

namespace nq::kernels::cuda {
namespace {

// out[w * 16 + i] = decoded weight of code i of word w (2-bit from base, then 4-bit); out_even the
// even-grid decode (code * 4^j * 2^-24) of the same base words; out_nested the uniform nested
// 4-bit decode ((4 b + r) * 4^(j - 1) * 2^-24) of the base and residual words.
__global__ void DecodeWordsKernel(const float* levels, const std::uint32_t* base, const std::uint32_t* residual,
                                  int n, __half* out2, __half* out4, __half* out_even, __half* out_nested) {
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  if (w >= n) return;
  LevelBytes2 t2;
  LevelBytes4 t4;
  PackLevelBytes(levels, kNqBaseLevels, &t2.lo, &t2.hi);
  PackLevelBytes(levels + kNqBaseLevels, kNqLevels4, t4.lo, t4.hi);
  __half2 p2[kPairsPerWord], p4[kPairsPerWord], pe[kPairsPerWord], pn[kPairsPerWord];
  DecodeWord2(t2, base[w], p2);
  DecodeWord4(t4, base[w], residual[w], p4);
  DecodeWord2EvenGrid(base[w], pe);
  DecodeWord4UniformNested(base[w], residual[w], pn);
  for (int i = 0; i < kCodesPerWord; ++i) {
    const int slot = PairSlot(i);
    out2[w * kCodesPerWord + i] = (slot & 1) ? __high2half(p2[slot / 2]) : __low2half(p2[slot / 2]);
    out4[w * kCodesPerWord + i] = (slot & 1) ? __high2half(p4[slot / 2]) : __low2half(p4[slot / 2]);
    out_even[w * kCodesPerWord + i] = (slot & 1) ? __high2half(pe[slot / 2]) : __low2half(pe[slot / 2]);
    out_nested[w * kCodesPerWord + i] = (slot & 1) ? __high2half(pn[slot / 2]) : __low2half(pn[slot / 2]);
  }
}

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

TEST(CudaNqMoe, CodeLookupEqualsTheDecoderLevelsBitForBit) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(9101);
  // The fixture's level tables are built like nq encode's (on the fp16 grid).
  const testing::NqMoeHost host = testing::RandomNqMoe(rng, 64, 16, 6);
  constexpr int kWords = 4096;
  std::uniform_int_distribution<std::uint32_t> bits;
  std::vector<std::uint32_t> base(kWords), residual(kWords);
  for (int w = 0; w < kWords; ++w) {
    base[w] = bits(rng);
    residual[w] = bits(rng);
  }
  float* d_levels = nullptr;
  std::uint32_t *d_base = nullptr, *d_residual = nullptr;
  __half *d_out2 = nullptr, *d_out4 = nullptr, *d_even = nullptr, *d_nested = nullptr;
  ASSERT_EQ(cudaMalloc(&d_levels, kNqLevelTable * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_base, kWords * sizeof(std::uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_residual, kWords * sizeof(std::uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out2, kWords * kCodesPerWord * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out4, kWords * kCodesPerWord * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_even, kWords * kCodesPerWord * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_nested, kWords * kCodesPerWord * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_base, base.data(), kWords * sizeof(std::uint32_t), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_residual, residual.data(), kWords * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::int64_t checked = 0, checked_even = 0, checked_nested = 0, tables = 0, even_tables = 0, nested_tables = 0;
  for (const testing::NqProjectionHost* proj : {&host.gate, &host.up, &host.down}) {
    for (std::size_t e = 0; e * kNqLevelTable < proj->levels.size(); ++e) {
      const float* levels = proj->levels.data() + e * kNqLevelTable;
      ASSERT_EQ(cudaMemcpy(d_levels, levels, kNqLevelTable * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      DecodeWordsKernel<<<kWords / 128, 128>>>(d_levels, d_base, d_residual, kWords, d_out2, d_out4, d_even,
                                               d_nested);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      std::vector<__half> out2(kWords * kCodesPerWord), out4(kWords * kCodesPerWord), even(kWords * kCodesPerWord),
          nested(kWords * kCodesPerWord);
      ASSERT_EQ(cudaMemcpy(out2.data(), d_out2, out2.size() * sizeof(__half), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(out4.data(), d_out4, out4.size() * sizeof(__half), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(even.data(), d_even, even.size() * sizeof(__half), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(nested.data(), d_nested, nested.size() * sizeof(__half), cudaMemcpyDeviceToHost),
                cudaSuccess);
      // The fixture gives even experts an even base grid, odd ones free levels, and every fourth
      // (e % 4 == 2) uniform nested levels.
      const float step = EvenGridStep(levels);
      ASSERT_EQ(step != 0.0f, e % 2 == 0) << "expert " << e;
      const float nested_step = UniformNestedStep(levels, levels + kNqBaseLevels);
      ASSERT_EQ(nested_step != 0.0f, e % 4 == 2) << "expert " << e;
      ++tables;
      if (step != 0.0f) ++even_tables;
      if (nested_step != 0.0f) ++nested_tables;
      for (int w = 0; w < kWords; ++w) {
        for (int i = 0; i < kCodesPerWord; ++i) {
          const int b = (base[w] >> (2 * i)) & 3, r = (residual[w] >> (2 * i)) & 3;
          const float want2 = levels[b], want4 = levels[kNqBaseLevels + 4 * b + r];
          ASSERT_EQ(__half2float(out2[w * kCodesPerWord + i]), want2) << "word " << w << " code " << i;
          ASSERT_EQ(__half2float(out4[w * kCodesPerWord + i]), want4) << "word " << w << " code " << i;
          checked += 2;
          // code * 4^j * 2^-24 exactly (a subnormal), and (that / the unit / 4^j - 1.5) times the
          // step, as the GEMV applies them in fp32, is the decoder's level.
          const float unit = kEvenGridUnit * static_cast<float>(1 << (2 * EvenGridShift(i % kPairsPerWord)));
          const float code = __half2float(even[w * kCodesPerWord + i]) / unit;
          ASSERT_EQ(code, static_cast<float>(b)) << "word " << w << " code " << i;
          if (step != 0.0f) {
            ASSERT_EQ(step * (code - 1.5f), want2) << "word " << w << " code " << i;
            ++checked_even;
          }
          // (4 b + r) * 4^(j - 1) * 2^-24 exactly, and s / 4 * (that / the unit - 7.5) is the
          // decoder's 4-bit level.
          const float code4 = __half2float(nested[w * kCodesPerWord + i]) / (unit / 4.0f);
          ASSERT_EQ(code4, static_cast<float>(4 * b + r)) << "word " << w << " code " << i;
          if (nested_step != 0.0f) {
            ASSERT_EQ(0.25f * (nested_step * (code4 - 7.5f)), want4) << "word " << w << " code " << i;
            ++checked_nested;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_GT(checked_even, 0);
  EXPECT_GT(checked_nested, 0);
  EXPECT_GT(even_tables, 0);
  EXPECT_LT(even_tables, tables);
  EXPECT_GT(nested_tables, 0);
  EXPECT_LT(nested_tables, even_tables);
  for (void* p : {static_cast<void*>(d_levels), static_cast<void*>(d_base), static_cast<void*>(d_residual),
                  static_cast<void*>(d_out2), static_cast<void*>(d_out4), static_cast<void*>(d_even),
                  static_cast<void*>(d_nested)}) {
    EXPECT_EQ(cudaFree(p), cudaSuccess);
  }
}

}  // namespace
}  // namespace nq::kernels::cuda
