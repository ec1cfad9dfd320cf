// The CPU Nvfp4Moe op (the oracle of the CUDA kernels) against a double-precision dense reference
// from the decoded weights and against a hand-computed layer; NaN block scales; the op's argument
// checks.
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/nvfp4_moe_fixture.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::Nvfp4ScaleDraw;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadBytes;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

// fp32 block sums against double: a few ulps of the largest output.
constexpr double kTolerance = 1e-5;

TEST(CpuNvfp4Moe, MatchesTheDecodedDenseReference) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(5201);
  struct Case {
    std::int64_t D, I, E, K, T;
    Nvfp4ScaleDraw draw;
  };
  for (const Case c : {Case{64, 32, 8, 3, 5, Nvfp4ScaleDraw::kTypical}, Case{16, 16, 4, 2, 3, Nvfp4ScaleDraw::kFullRange},
                       Case{256, 64, 32, 4, 4, Nvfp4ScaleDraw::kTypical},
                       Case{96, 48, 6, 6, 2, Nvfp4ScaleDraw::kFullRange}}) {
    SCOPED_TRACE(absl::StrCat("D ", c.D, " I ", c.I, " E ", c.E, " K ", c.K, " T ", c.T));
    const testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, c.D, c.I, c.E, c.draw);
    const std::vector<float> x = RandomNormal(rng, c.T * c.D, 1.0f);
    const testing::Nvfp4Routing routing = testing::RandomNvfp4Routing(rng, c.T, c.K, c.E);
    const std::vector<float> got = testing::RunNvfp4Moe(*cpu, host, x, routing.ids, routing.weights, c.K);
    const std::vector<double> want = testing::RefNvfp4Moe(host, x, routing.ids, routing.weights, c.K);
    EXPECT_LT(NormalizedError(got, want), kTolerance);
  }
}

TEST(CpuNvfp4Moe, HandComputedBlocks) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  constexpr std::int64_t kDim = 32;
  const testing::Nvfp4MoeHost host = testing::HandComputedNvfp4Moe(kDim);
  const std::vector<float> x(kDim, 1.0f);
  const std::vector<float> got = testing::RunNvfp4Moe(*cpu, host, x, {0}, {0.25f}, 1);
  ASSERT_EQ(got.size(), static_cast<std::size_t>(kDim));
  const double want = testing::HandComputedNvfp4Output(kDim, 0.25);
  for (const float v : got) EXPECT_NEAR(v, want, 1e-6 * std::abs(want));
}

// A NaN block scale (0x7F) in one down row poisons exactly that output of the tokens routed to
// its expert.
TEST(CpuNvfp4Moe, NanBlockScaleReachesOnlyItsRow) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(5202);
  constexpr std::int64_t kD = 64, kI = 32, kE = 4, kK = 2, kRow = 5;
  testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, kD, kI, kE, Nvfp4ScaleDraw::kTypical);
  host.down.scales[(2 * kD + kRow) * (kI / 16) + 1] = 0x7F;  // expert 2, row kRow, block 1
  const std::vector<float> x = RandomNormal(rng, 2 * kD, 1.0f);
  const std::vector<float> got = testing::RunNvfp4Moe(*cpu, host, x, {2, 0, 1, 3}, {0.5f, 0.5f, 0.5f, 0.5f}, kK);
  ASSERT_EQ(got.size(), static_cast<std::size_t>(2 * kD));
  for (std::int64_t d = 0; d < kD; ++d) {
    EXPECT_EQ(std::isnan(got[d]), d == kRow) << d;
    EXPECT_FALSE(std::isnan(got[kD + d])) << d;
  }
}

class CpuNvfp4MoeArgs : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng = MakeRng(5203);
    host_ = testing::RandomNvfp4Moe(rng, kD, kI, kE, Nvfp4ScaleDraw::kTypical);
    x_ = Upload(*cpu_, std::vector<float>(kD, 1.0f), DType::kF32, Shape{1, kD});
    w_ = Upload(*cpu_, std::vector<float>{0.5f, 0.5f}, DType::kF32, Shape{1, 2});
    out_ = AllocateOrFail(*cpu_, DType::kF32, Shape{1, kD});
  }
  // A fresh upload of the layer (tensors are move-only), for a test to spoil.
  Nvfp4MoeWeights Layer() { return testing::UploadNvfp4Moe(*cpu_, host_); }
  absl::Status Run(const Nvfp4MoeWeights& w, const std::vector<std::int32_t>& ids) {
    const Tensor t = UploadI32(*cpu_, ids, Shape{1, 2});
    return cpu_->Nvfp4Moe(x_, t, w_, w, out_);
  }
  static constexpr std::int64_t kD = 32, kI = 16, kE = 4;
  std::unique_ptr<Backend> cpu_ = MakeCpuBackend();
  testing::Nvfp4MoeHost host_;
  Tensor x_, w_, out_;
};

TEST_F(CpuNvfp4MoeArgs, RefusesAnExpertOutOfRangeOrRepeated) {
  const Nvfp4MoeWeights w = Layer();
  EXPECT_THAT(Run(w, {0, 4}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names expert 4 of 4")));
  EXPECT_THAT(Run(w, {1, 1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  NQ_EXPECT_OK(Run(w, {1, 3}));
}

TEST_F(CpuNvfp4MoeArgs, RefusesMisshapenScalesAndWrongDtypes) {
  Nvfp4MoeWeights bad = Layer();
  // One block a row too many (I / 16 = 1).
  bad.down.scales = UploadBytes(*cpu_, std::vector<std::uint8_t>(kE * kD * 2), DType::kF8E4M3, Shape{kE, kD, 2});
  EXPECT_THAT(Run(bad, {0, 1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("down.scales")));
  bad = Layer();
  bad.gate_up.scales = UploadBytes(*cpu_, host_.gate_up.scales, DType::kU8, Shape{kE, 2 * kI, kD / 16});
  EXPECT_THAT(Run(bad, {0, 1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("want F8_E4M3")));
  bad = Layer();
  bad.gate_up.global_scales = Tensor();
  EXPECT_THAT(Run(bad, {0, 1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gate_up.global_scales")));
  bad = Layer();
  bad.hidden = 24;
  EXPECT_THAT(Run(bad, {0, 1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiples of 16")));
}

TEST_F(CpuNvfp4MoeArgs, RefusesANonFiniteGlobalScale) {
  Nvfp4MoeWeights bad = Layer();
  std::vector<float> global = host_.down.global;
  global[1] = NAN;
  bad.down.global_scales = Upload(*cpu_, global, DType::kF32, Shape{kE});
  EXPECT_THAT(Run(bad, {0, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert 1 has a non-finite global scale")));
}

}  // namespace
}  // namespace nq::kernels
