// The CPU NVFP4 dequant-GEMV against dequantise-then-matmul.
#include "kernels/cpu/nvfp4_gemv.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "services/nvfp4/nvfp4_quantizer.h"
#include "tests/common/status_matchers.h"

namespace nq::nvfp4 {
namespace {

using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

struct Shape {
  int64_t m, n, k;
  int threads;
};

class Nvfp4GemvTest : public ::testing::TestWithParam<Shape> {};

TEST_P(Nvfp4GemvTest, MatchesDequantiseThenMatmul) {
  const Shape s = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(s.n * 31 + s.k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(s.n * s.k), x(s.m * s.k);
  for (float& v : w) v = 0.05f * normal(rng);
  for (float& v : x) v = normal(rng);
  absl::StatusOr<QuantizeResult> q = QuantizeNvfp4(w, s.n, s.k);
  ASSERT_TRUE(q.ok());
  absl::StatusOr<std::vector<float>> dense = Dequantize(q->tensor.view());
  ASSERT_TRUE(dense.ok());

  std::vector<float> y(s.m * s.n, -1.0f);
  kernels::cpu::Nvfp4GemvParams params;
  params.packed = q->tensor.packed.data();
  params.scales = q->tensor.scales.data();
  params.global_scale = q->tensor.scale_2;
  params.x = x.data();
  params.y = y.data();
  params.m = s.m;
  params.n = s.n;
  params.k = s.k;
  ASSERT_TRUE(kernels::cpu::Nvfp4Gemv(params, s.threads).ok());

  double max_ref = 0, max_diff = 0;
  for (int64_t t = 0; t < s.m; ++t) {
    for (int64_t r = 0; r < s.n; ++r) {
      double ref = 0;
      for (int64_t c = 0; c < s.k; ++c) ref += static_cast<double>((*dense)[r * s.k + c]) * x[t * s.k + c];
      max_ref = std::max(max_ref, std::fabs(ref));
      max_diff = std::max(max_diff, std::fabs(ref - y[t * s.n + r]));
    }
  }
  // fp32 accumulation over k terms against a double reference.
  EXPECT_LT(max_diff / max_ref, 1e-5) << "max |diff| " << max_diff << " of max |y| " << max_ref;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Nvfp4GemvTest,
                         ::testing::Values(Shape{1, 64, 256, 1}, Shape{1, 300, 512, 2}, Shape{3, 128, 1024, 2},
                                           Shape{2, 7, 16, 1}));

TEST(Nvfp4Gemv, RefusesBadArguments) {
  std::vector<uint8_t> packed(8), scales(1);
  std::vector<float> x(24), y(1);
  kernels::cpu::Nvfp4GemvParams params{packed.data(), scales.data(), 1.0f, x.data(), y.data(), 1, 1, 24};
  EXPECT_THAT(kernels::cpu::Nvfp4Gemv(params), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k % 16")));
  params.k = 16;
  params.x = nullptr;
  EXPECT_THAT(kernels::cpu::Nvfp4Gemv(params), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
}

}  // namespace
}  // namespace nq::nvfp4
