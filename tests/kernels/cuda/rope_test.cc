// CUDA Rope vs the CPU backend on fresh random inputs: both pair layouts, yarn scaling, positions
// up to 160k (where the fp32 angle rounding matters).
#include <array>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::Upload;

// The same fp32 angles; sincosf within 2 ulp of glibc's; the rotation in fp32 vs double.
constexpr double kTolerance = 1e-5;

TEST(CudaRope, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3301);
  struct Case {
    std::int64_t tokens, heads, dim, start_pos;
  };
  // 128 x 64: DeepSeek-V3's query rope part; 1 x 64: its shared key rope part.
  std::vector<Case> cases = {{1, 1, 2, 0},     {3, 5, 6, 7},       {16, 128, 64, 0},
                             {1, 1, 64, 4095}, {512, 128, 64, 30}, {2, 16, 64, 163000}};
  for (int i = 0; i < 3; ++i) {
    cases.push_back({RandomInt(rng, 1, 40), RandomInt(rng, 1, 32), 2 * RandomInt(rng, 1, 64),
                     RandomInt(rng, 0, 100000)});
  }
  for (bool interleaved : {true, false}) {
    ErrorSummary summary(absl::StrCat("Rope interleaved=", interleaved), kTolerance);
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat("interleaved=", interleaved, " T=", c.tokens, " n=", c.heads,
                                " d=", c.dim, " start=", c.start_pos));
      const Shape shape{c.tokens, c.heads, c.dim};
      const std::vector<float> x = RandomNormal(rng, shape.NumElements(), 1.0f);
      const std::vector<float> inv_freq = RandomUniform(rng, c.dim / 2, 1e-4f, 1.0f);
      const float scaling = interleaved ? 1.3678f : 1.0f;
      std::vector<float> outputs[2];
      int i = 0;
      for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
        Tensor tx = Upload(*backend, x, DType::kF32, shape);
        NQ_ASSERT_OK(backend->Rope(tx, c.start_pos, inv_freq, scaling, interleaved));
        outputs[i++] = Download(*backend, tx);
      }
      summary.Add(NormalizedError(outputs[1], outputs[0]));
    }
  }
}

// One launch over both of a layer's query tensors at GLM-5's shapes (64 heads of 64, the MLA rope
// part, interleaved; 32 indexer heads of 128 with a 64-wide rope slice, halves): each equals its
// own launch bit for bit, and the CPU within the tolerance above.
TEST(CudaRope, SeveralTargetsInOneLaunchEqualOneLaunchEach) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3302);
  Backend& cuda = *Backends().cuda;
  const std::vector<float> inv_freq = RandomUniform(rng, 32, 1e-4f, 1.0f);
  for (std::int64_t tokens : {1, 4, 37}) {
    SCOPED_TRACE(absl::StrCat("tokens ", tokens));
    const Shape q_shape{tokens, 64, 64}, qi_shape{tokens, 32, 128};
    const std::vector<float> q = RandomNormal(rng, q_shape.NumElements(), 1.0f);
    const std::vector<float> qi = RandomNormal(rng, qi_shape.NumElements(), 1.0f);
    std::vector<float> together[2][2];  // [backend][target]
    int b = 0;
    for (Backend* backend : {Backends().cpu.get(), &cuda}) {
      Tensor tq = Upload(*backend, q, DType::kF32, q_shape);
      Tensor tqi = Upload(*backend, qi, DType::kF32, qi_shape);
      const std::array<Backend::RopeTarget, 2> targets{{{.x = &tq, .interleaved = true}, {.x = &tqi}}};
      NQ_ASSERT_OK(backend->Rope(targets, 4000, inv_freq, 1.0f));
      together[b][0] = Download(*backend, tq);
      together[b][1] = Download(*backend, tqi);
      ++b;
    }
    Tensor alone_q = Upload(cuda, q, DType::kF32, q_shape);
    Tensor alone_qi = Upload(cuda, qi, DType::kF32, qi_shape);
    NQ_ASSERT_OK(cuda.Rope(alone_q, 4000, inv_freq, 1.0f, true));
    NQ_ASSERT_OK(cuda.Rope(alone_qi, 4000, inv_freq, 1.0f, false));
    EXPECT_EQ(together[1][0], Download(cuda, alone_q));
    EXPECT_EQ(together[1][1], Download(cuda, alone_qi));
    EXPECT_LT(NormalizedError(together[1][0], together[0][0]), kTolerance);
    EXPECT_LT(NormalizedError(together[1][1], together[0][1]), kTolerance);
  }
}

}  // namespace
}  // namespace nq::kernels
