// CUDA LayerNorm vs the CPU backend on fresh random inputs (with a large common offset, so the
// two-pass variance matters), out of place and in place.
#include <cstdint>
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

// fp32 tree sums (mean, then variance about it) against the CPU's double.
constexpr double kTolerance = 1e-5;
constexpr float kEps = 1e-6f;

TEST(CudaLayerNorm, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3401);
  // 128: the DSA indexer's key norm (one row per token).
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {{1, 1},   {3, 5},     {4096, 128},
                                                              {7, 513}, {64, 7168}, {1, 16384}};
  for (int i = 0; i < 3; ++i) cases.emplace_back(RandomInt(rng, 1, 300), RandomInt(rng, 1, 9000));
  ErrorSummary summary("LayerNorm", kTolerance);
  for (const auto& [rows, cols] : cases) {
    SCOPED_TRACE(absl::StrCat("rows=", rows, " cols=", cols));
    std::vector<float> x = RandomNormal(rng, rows * cols, 2.0f);
    for (float& v : x) v += 50.0f;
    const std::vector<float> w = RandomUniform(rng, cols, 0.5f, 1.5f);
    const std::vector<float> b = RandomNormal(rng, cols, 0.5f);
    std::vector<float> outputs[2];
    std::vector<float> in_place[2];
    int i = 0;
    for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
      Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
      Tensor tw = Upload(*backend, w, DType::kF32, {cols});
      Tensor tb = Upload(*backend, b, DType::kF32, {cols});
      Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
      NQ_ASSERT_OK(backend->LayerNorm(tx, tw, tb, kEps, ty));
      NQ_ASSERT_OK(backend->LayerNorm(tx, tw, tb, kEps, tx));
      outputs[i] = Download(*backend, ty);
      in_place[i++] = Download(*backend, tx);
    }
    summary.Add(NormalizedError(outputs[1], outputs[0]));
    EXPECT_TRUE(in_place[1] == outputs[1]) << "in place differs from out of place on CUDA";
  }
}

}  // namespace
}  // namespace nq::kernels
