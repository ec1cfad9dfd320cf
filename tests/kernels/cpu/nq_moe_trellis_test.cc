// The CPU NqMoe op on trellis_v1 layers against the fixture's dense reference (every weight decoded
// byte-wise from its tile, rotations as dense matrices, double), and the op's trellis argument
// checks. The round trip through TrellisCodec itself is nq_moe_trellis_codec_test.cc.
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/nq_moe_fixture.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

TEST(CpuNqMoeTrellis, MatchesTheDenseReferenceAtTwoFourAndMixedBits) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4211);
  // Two tile rows and columns at least on every side, so tile order differs from row order.
  constexpr std::int64_t kD = 64, kI = 32, kE = 8, kK = 3, kT = 5;
  const testing::NqMoeHost host = testing::RandomTrellisNqMoe(rng, kD, kI, kE);
  const std::vector<float> x = RandomNormal(rng, kT * kD, 1.0f);
  const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, kT, kK, kE, kE);
  const std::vector<std::vector<std::int32_t>> precisions = {
      std::vector<std::int32_t>(kE, -1), {0, 1, 2, 3, 4, 5, 6, 7}, {-1, 0, -1, 1, 2, -1, -1, 3}};
  for (const std::vector<std::int32_t>& slots : precisions) {
    const std::vector<float> got = testing::RunNqMoe(*cpu, host, slots, x, routing, kK);
    const std::vector<double> want = testing::DenseNqMoeReference(host, x, routing.ids, routing.weights, kK, slots);
    EXPECT_LT(NormalizedError(got, want), 1e-5);
  }
}

TEST(CpuNqMoeTrellis, ResidualGainsMoveOnlyFourBitExperts) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4212);
  constexpr std::int64_t kD = 32, kI = 16, kE = 4;
  testing::NqMoeHost host = testing::RandomTrellisNqMoe(rng, kD, kI, kE);
  const std::vector<float> x = RandomNormal(rng, 2 * kD, 1.0f);
  const testing::NqMoeRouting routing{.ids = {1, 2, 2, 1}, .weights = {0.7f, 0.3f, 0.6f, 0.4f}};
  const std::vector<std::int32_t> slots = {-1, 0, -1, -1};  // expert 1 at 4 bits, 2 at 2 bits
  const std::vector<float> before = testing::RunNqMoe(*cpu, host, slots, x, routing, 2);
  // Doubling every residual gain of expert 2 (at 2 bits) changes nothing; of expert 1, the output.
  testing::NqMoeHost two = host;
  const std::int64_t blocks = kD / 16;
  for (std::int64_t b = 0; b < blocks; ++b) two.gate.gains[(2 * blocks + b) * 2 + 1] *= 2.0f;
  EXPECT_EQ(testing::RunNqMoe(*cpu, two, slots, x, routing, 2), before);
  testing::NqMoeHost one = host;
  for (std::int64_t b = 0; b < blocks; ++b) one.gate.gains[(1 * blocks + b) * 2 + 1] *= 2.0f;
  EXPECT_NE(testing::RunNqMoe(*cpu, one, slots, x, routing, 2), before);
}

class CpuNqMoeTrellisArgs : public ::testing::Test {
 protected:
  static constexpr std::int64_t kD = 32, kI = 16, kE = 4;
  void SetUp() override {
    cpu_ = MakeCpuBackend();
    std::mt19937_64 rng = MakeRng(4213);
    host_ = testing::RandomTrellisNqMoe(rng, kD, kI, kE);
    layer_ = testing::UploadNqMoe(*cpu_, host_, std::vector<std::int32_t>(kE, -1));
    layer_.slots.slot_of_expert = &layer_.slot_table;  // it pointed into the moved-from layer
    x_ = Upload(*cpu_, RandomNormal(rng, kD, 1.0f), DType::kF32, {1, kD});
    ids_ = UploadI32(*cpu_, std::vector<std::int32_t>{0, 1}, {1, 2});
    weights_ = Upload(*cpu_, std::vector<float>{0.5f, 0.5f}, DType::kF32, {1, 2});
    absl::StatusOr<Tensor> out = cpu_->Allocate(DType::kF32, Shape{1, kD});
    ASSERT_TRUE(out.ok());
    out_ = *std::move(out);
  }
  absl::Status Run(const NqMoeWeights& w) { return cpu_->NqMoe(x_, ids_, weights_, w, layer_.slots, out_); }

  std::unique_ptr<Backend> cpu_;
  testing::NqMoeHost host_;
  testing::NqMoeDevice layer_;
  Tensor x_, ids_, weights_, out_;
};

TEST_F(CpuNqMoeTrellisArgs, RunsAsUploaded) { NQ_EXPECT_OK(Run(layer_.weights)); }

TEST_F(CpuNqMoeTrellisArgs, RefusesGainsOfTheWrongShape) {
  // up's gains sized for its rows (I / 16 blocks) instead of its columns (D / 16).
  layer_.weights.up.gains = Upload(*cpu_, std::vector<float>(kE * (kI / 16) * 2, 1.0f), DType::kF32, {kE, kI / 16, 2});
  EXPECT_THAT(Run(layer_.weights), testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                     HasSubstr("up.gains is F32[4, 1, 2], want F32[4, 2, 2]")));
  // One gain per block instead of a (base, residual) pair.
  layer_.weights.up.gains = Upload(*cpu_, std::vector<float>(kE * (kD / 16), 1.0f), DType::kF32, {kE, kD / 16});
  EXPECT_THAT(Run(layer_.weights),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("up.gains is F32[4, 2], want")));
}

TEST_F(CpuNqMoeTrellisArgs, RefusesMissingGainsAndAScalarLevelTable) {
  layer_.weights.down.gains = Tensor();
  EXPECT_THAT(Run(layer_.weights),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("down.gains is an empty tensor")));
  layer_.weights.down.gains = Upload(*cpu_, host_.down.gains, DType::kF32, {kE, kI / 16, 2});
  layer_.weights.gate.levels = Upload(*cpu_, std::vector<float>(kE * kNqLevelTable, 0.5f), DType::kF32,
                                      {kE, kNqLevelTable});
  EXPECT_THAT(Run(layer_.weights),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("gate.levels is F32[4, 20] but a trellis_v1 layer takes only gains")));
}

TEST_F(CpuNqMoeTrellisArgs, RefusesAScalarLayerCarryingGains) {
  layer_.weights.codec = NqCodec::kNestedScalar;
  EXPECT_THAT(Run(layer_.weights),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("gate.gains is F32[4, 2, 2] but a nested_scalar_v1 layer takes only levels")));
}

TEST_F(CpuNqMoeTrellisArgs, RefusesPlanesOfTheWrongSizeAndPartialTiles) {
  layer_.weights.gate.base = UploadI32(*cpu_, std::vector<std::int32_t>(kE * 8, 0), {kE, 8});
  EXPECT_THAT(Run(layer_.weights),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gate.base is I32[4, 8], want U8[4, 128]")));

  // A 24-wide intermediate is a whole number of 2-bit bytes but not of 16 x 16 tiles.
  std::mt19937_64 rng = MakeRng(4214);
  testing::NqMoeHost narrow = testing::RandomNqMoe(rng, kD, 24, kE);
  testing::NqMoeDevice scalar = testing::UploadNqMoe(*cpu_, narrow, std::vector<std::int32_t>(kE, -1));
  NqMoeWeights w = std::move(scalar.weights);
  w.codec = NqCodec::kTrellis;
  for (NqProjection* p : {&w.gate, &w.up, &w.down}) {
    p->levels = Tensor();
    p->gains = Upload(*cpu_, std::vector<float>(kE * 2 * 2, 1.0f), DType::kF32, {kE, 2, 2});
  }
  EXPECT_THAT(cpu_->NqMoe(x_, ids_, weights_, w, scalar.slots, out_),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("gate is 24 x 32; trellis_v1 codes whole 16 x 16 tiles")));
}

TEST_F(CpuNqMoeTrellisArgs, RefusesAnUnknownCodec) {
  layer_.weights.codec = static_cast<NqCodec>(7);
  EXPECT_THAT(Run(layer_.weights), testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                     HasSubstr("codec 7 is neither nested_scalar_v1 nor trellis_v1")));
}

}  // namespace
}  // namespace nq::kernels
