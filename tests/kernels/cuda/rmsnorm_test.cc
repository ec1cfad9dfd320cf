// CUDA RmsNorm vs the CPU backend on fresh random inputs, weights F32 / BF16 / F16; AddRmsNorm
// (the residual added in the norm's kernel) against the Adds and the RmsNorm it replaces.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::Upload;

// fp32 elementwise after a tree reduction; rsqrtf is within 2 ulp.
constexpr double kTolerance = 1e-5;
constexpr float kEps = 1e-6f;

TEST(CudaRmsNorm, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1201);
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {
      {1, 1}, {1, 7168}, {3, 5}, {7, 513}, {64, 1536}, {33, 4099}, {128, 512}, {2, 16384},
      {1024, 7168}};
  for (int i = 0; i < 3; ++i) cases.emplace_back(RandomInt(rng, 1, 300), RandomInt(rng, 1, 9000));
  for (DType w_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    ErrorSummary summary(absl::StrCat("RmsNorm weight=", DTypeName(w_dtype)), kTolerance);
    for (const auto& [rows, cols] : cases) {
      SCOPED_TRACE(absl::StrCat("weight ", DTypeName(w_dtype), " rows=", rows, " cols=", cols));
      const std::vector<float> x = RandomNormal(rng, rows * cols, 2.0f);
      const std::vector<float> w = RandomUniform(rng, cols, 0.5f, 1.5f);
      std::vector<float> outputs[2];
      int i = 0;
      for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
        Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
        Tensor tw = Upload(*backend, w, w_dtype, {cols});
        Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
        NQ_ASSERT_OK(backend->RmsNorm(tx, tw, kEps, ty));
        outputs[i++] = Download(*backend, ty);
      }
      summary.Add(NormalizedError(outputs[1], outputs[0]));
    }
  }
}

TEST(CudaRmsNorm, RunsInPlace) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1202);
  const std::vector<float> x = RandomNormal(rng, 5 * 7168, 1.0f);
  const std::vector<float> w = RandomUniform(rng, 7168, 0.5f, 1.5f);
  std::vector<float> outputs[2];
  int i = 0;
  for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
    Tensor tx = Upload(*backend, x, DType::kF32, {5, 7168});
    Tensor tw = Upload(*backend, w, DType::kBF16, {7168});
    NQ_ASSERT_OK(backend->RmsNorm(tx, tw, kEps, tx));
    outputs[i++] = Download(*backend, tx);
  }
  EXPECT_LT(NormalizedError(outputs[1], outputs[0]), kTolerance);
}

// x += d0 (+ d1), y = RmsNorm(x), one kernel: bit for bit what the Add kernels and the RmsNorm
// kernel give one after another on the GPU (the rows in registers up to 8192 columns, re-read
// above, odd widths without float4s), y apart or in place; and close to the CPU's.
TEST(CudaAddRmsNorm, EqualsTheAddsThenTheNormBitForBit) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(1203);
  for (const auto& [rows, cols] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 6144}, {4, 7168}, {2, 16384}, {3, 13}, {5, 8192}}) {
    for (int count : {1, 2}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(absl::StrCat("rows=", rows, " cols=", cols, " deltas=", count, " in place ", in_place));
        const std::vector<float> x = RandomNormal(rng, rows * cols, 3.0f);
        const std::vector<float> d0 = RandomNormal(rng, rows * cols, 1.0f);
        const std::vector<float> d1 = RandomNormal(rng, rows * cols, 1.0f);
        const std::vector<float> w = RandomUniform(rng, cols, 0.5f, 1.5f);
        std::vector<float> fused_x, fused_y;
        for (Backend* backend : {&cuda, Backends().cpu.get()}) {
          Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
          Tensor t0 = Upload(*backend, d0, DType::kF32, {rows, cols});
          Tensor t1 = Upload(*backend, d1, DType::kF32, {rows, cols});
          Tensor tw = Upload(*backend, w, DType::kBF16, {cols});
          Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
          const Tensor* deltas[] = {&t0, &t1};
          NQ_ASSERT_OK(backend->AddRmsNorm(tx, std::span(deltas, count), tw, kEps, in_place ? tx : ty));
          if (backend == &cuda) {
            fused_x = Download(cuda, tx);
            fused_y = Download(cuda, in_place ? tx : ty);
            // The same on the GPU op by op.
            Tensor ux = Upload(cuda, x, DType::kF32, {rows, cols});
            Tensor uy = AllocateOrFail(cuda, DType::kF32, {rows, cols});
            if (count == 2) NQ_ASSERT_OK(cuda.Add(t0, t1, t0));
            NQ_ASSERT_OK(cuda.Add(ux, t0, ux));
            NQ_ASSERT_OK(cuda.RmsNorm(ux, tw, kEps, uy));
            EXPECT_EQ(fused_y, Download(cuda, uy));
            if (!in_place) EXPECT_EQ(fused_x, Download(cuda, ux));
          } else {
            EXPECT_LT(NormalizedError(fused_y, Download(*backend, in_place ? tx : ty)), kTolerance);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace nq::kernels
