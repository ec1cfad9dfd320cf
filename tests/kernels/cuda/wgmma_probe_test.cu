// wgmma (kernels/cuda/wgmma.cuh) against the CPU: one warpgroup multiplies 64 x 64 bf16 tiles held
// in shared memory with the 128-byte swizzle, K = 64 (four k-steps), in both operand layouts an MLA
// kernel on wgmma would use: K-major A and B (scores = Q K^T) and a K-major A with an N-major B
// (O = P V, V a key a row). Small integer inputs, so every product and sum is exact in fp32 and
// the results must be equal.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/wgmma.cuh"

namespace nq::kernels::cuda {
namespace {

constexpr int kTile = 64;  // rows and bf16 columns of each tile (a column is 128 bytes)

// Byte offset of element (row, col) of a 64-column bf16 tile under the 128-byte swizzle.
__host__ __device__ int SwizzledOffset(int row, int col) {
  const int chunk = col * 2 / 16, within = col * 2 % 16;
  return row * 128 + (chunk ^ (row % 8)) * 16 + within;
}

// a: [64][64] row-major, M x K. b: [64][64] row-major, N x K (K-major) or, kTransposeB, K x N
// (N-major). d = A B with B taken as K x N.
template <bool kTransposeB>
__global__ void WgmmaProbeKernel(const std::uint16_t* a, const std::uint16_t* b, float* d) {
  __shared__ __align__(1024) std::uint16_t sa[kTile * kTile];
  __shared__ __align__(1024) std::uint16_t sb[kTile * kTile];
  for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
    const int r = i / kTile, c = i % kTile;
    sa[SwizzledOffset(r, c) / 2] = a[i];
    sb[SwizzledOffset(r, c) / 2] = b[i];
  }
  __syncthreads();
  wgmma::FenceSharedWrites();
  float acc[32];
  for (float& v : acc) v = 0.0f;
  wgmma::Fence();
  const auto* a_bytes = reinterpret_cast<const unsigned char*>(sa);
  const auto* b_bytes = reinterpret_cast<const unsigned char*>(sb);
  for (int ks = 0; ks < kTile / 16; ++ks) {
    const std::uint64_t da = wgmma::Descriptor(a_bytes + 32 * ks, 16, 1024, wgmma::Swizzle::k128B);
    const std::uint64_t db = wgmma::Descriptor(b_bytes + (kTransposeB ? 2048 : 32) * ks, 16, 1024, wgmma::Swizzle::k128B);
    wgmma::Mma64x64x16<kTransposeB>(acc, da, db, ks > 0);
  }
  wgmma::Commit();
  wgmma::Wait<0>();
  const int t = threadIdx.x, row = 16 * (t / 32) + t % 32 / 4;
  for (int j = 0; j < 8; ++j) {
    const int col = 8 * j + 2 * (t % 4);
    d[row * kTile + col] = acc[4 * j];
    d[row * kTile + col + 1] = acc[4 * j + 1];
    d[(row + 8) * kTile + col] = acc[4 * j + 2];
    d[(row + 8) * kTile + col + 1] = acc[4 * j + 3];
  }
}

std::uint16_t Bf16Bits(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<std::uint16_t>(u >> 16);  // exact for the small integers used here
}

template <bool kTransposeB>
void CheckAgainstCpu() {
  std::mt19937 rng(kTransposeB ? 7 : 3);
  std::uniform_int_distribution<int> value(-4, 4);
  std::vector<float> a(kTile * kTile), b(kTile * kTile);
  std::vector<std::uint16_t> a_bits(a.size()), b_bits(b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(value(rng));
    b[i] = static_cast<float>(value(rng));
    a_bits[i] = Bf16Bits(a[i]);
    b_bits[i] = Bf16Bits(b[i]);
  }
  std::uint16_t *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  ASSERT_EQ(cudaMalloc(&da, a_bits.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&db, b_bits.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dd, a.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(da, a_bits.data(), a_bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(db, b_bits.data(), b_bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dd, 0xff, a.size() * 4), cudaSuccess);  // NaNs where nothing is written
  WgmmaProbeKernel<kTransposeB><<<1, 128>>>(da, db, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got(a.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dd, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
  int wrong = 0;
  for (int m = 0; m < kTile; ++m) {
    for (int n = 0; n < kTile; ++n) {
      float want = 0.0f;
      for (int k = 0; k < kTile; ++k) want += a[m * kTile + k] * (kTransposeB ? b[k * kTile + n] : b[n * kTile + k]);
      if (got[m * kTile + n] != want && ++wrong <= 5) {
        ADD_FAILURE() << "D[" << m << "][" << n << "] = " << got[m * kTile + n] << ", want " << want;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
}

bool HasGpu() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

TEST(CudaWgmma, KMajorOperandsGiveTheCpuProduct) {
  if (!HasGpu()) GTEST_SKIP() << "no GPU";
  CheckAgainstCpu<false>();
}

TEST(CudaWgmma, NMajorBGivesTheCpuProduct) {
  if (!HasGpu()) GTEST_SKIP() << "no GPU";
  CheckAgainstCpu<true>();
}

}  // namespace
}  // namespace nq::kernels::cuda
