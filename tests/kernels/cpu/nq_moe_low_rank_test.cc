// The CPU NqMoe op's low-rank corrections (kernels/nq_moe.h, issue #16): resident factors move
// only their own expert's output, at both precisions; a slot's factors only at 4 bits; all-zero
// factors change nothing. Their argument checks, by name. (The release tests compare the op with
// corrections against the dense decoder: tests/release/low_rank_release_test.cc.) And the op with
// the fixture's random factors on every projection against the fixture's dense reference, which
// the CUDA tests then take as given (tests/kernels/cuda/nq_moe_low_rank_test.cc).
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
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

constexpr std::int64_t kD = 32, kI = 16, kE = 4, kR = 2;

class CpuNqMoeLowRank : public ::testing::Test {
 protected:
  void SetUp() override {
    cpu_ = MakeCpuBackend();
    rng_ = MakeRng(4301);
    host_ = testing::RandomNqMoe(rng_, kD, kI, kE);
    x_ = RandomNormal(rng_, kD, 1.0f);
  }

  // Expert `expert`'s output with down_proj's resident factors `u`, `v` (F32 [E, D, R], [E, R, I])
  // and, in slot 0 when expert 1 holds it, the fp16 slot factors `slot_factors` (down: [D, R] then
  // [R, I]) after the fixture's residual planes.
  std::vector<float> Run(std::int32_t expert, const std::vector<std::int32_t>& slots, const std::vector<float>& u,
                         const std::vector<float>& v, const std::vector<float>& slot_factors) {
    testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu_, host_, slots);
    const std::int64_t offset = layer.slots.slot_bytes;
    const std::int64_t slot_bytes = offset + 4096;
    std::vector<std::uint8_t> arena(static_cast<size_t>(std::max<std::int64_t>(layer.slots.num_slots, 1) * slot_bytes), 0);
    // CPU tensors are host memory: the fixture's arena is read in place.
    const auto* planes = static_cast<const std::uint8_t*>(layer.arena.data());
    for (std::int64_t s = 0; s < layer.slots.num_slots; ++s) {
      std::memcpy(arena.data() + s * slot_bytes, planes + s * layer.slots.slot_bytes, layer.slots.slot_bytes);
      for (size_t k = 0; k < slot_factors.size(); ++k) {
        const std::uint16_t bits = ToF16(slot_factors[k]).bits;
        arena[s * slot_bytes + offset + 2 * k] = static_cast<std::uint8_t>(bits & 0xff);
        arena[s * slot_bytes + offset + 2 * k + 1] = static_cast<std::uint8_t>(bits >> 8);
      }
    }
    Tensor arena_tensor = testing::UploadBytes(*cpu_, arena, DType::kU8, Shape{static_cast<std::int64_t>(arena.size())});
    layer.slots.arena = static_cast<const std::byte*>(arena_tensor.data());
    layer.slots.slot_bytes = slot_bytes;
    layer.weights.lowrank_rank = kR;
    layer.weights.down.lowrank_u = Upload(*cpu_, u, DType::kF32, {kE, kD, kR});
    layer.weights.down.lowrank_v = Upload(*cpu_, v, DType::kF32, {kE, kR, kI});
    layer.weights.down.lowrank_offset = offset;
    Tensor tx = Upload(*cpu_, x_, DType::kF32, {1, kD});
    Tensor ids = UploadI32(*cpu_, std::vector<std::int32_t>{expert}, {1, 1});
    Tensor weights = Upload(*cpu_, std::vector<float>{1.0f}, DType::kF32, {1, 1});
    absl::StatusOr<Tensor> out = cpu_->Allocate(DType::kF32, Shape{1, kD});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    const absl::Status s = cpu_->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out);
    EXPECT_TRUE(s.ok()) << s;
    return Download(*cpu_, *out);
  }
  // The same expert without any correction.
  std::vector<float> RunPlain(std::int32_t expert, const std::vector<std::int32_t>& slots) {
    testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu_, host_, slots);
    Tensor tx = Upload(*cpu_, x_, DType::kF32, {1, kD});
    Tensor ids = UploadI32(*cpu_, std::vector<std::int32_t>{expert}, {1, 1});
    Tensor weights = Upload(*cpu_, std::vector<float>{1.0f}, DType::kF32, {1, 1});
    absl::StatusOr<Tensor> out = cpu_->Allocate(DType::kF32, Shape{1, kD});
    EXPECT_TRUE(out.ok());
    if (!out.ok()) return {};
    EXPECT_TRUE(cpu_->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out).ok());
    return Download(*cpu_, *out);
  }

  std::unique_ptr<Backend> cpu_;
  std::mt19937_64 rng_;
  testing::NqMoeHost host_;
  std::vector<float> x_;
};

TEST_F(CpuNqMoeLowRank, ResidentFactorsMoveOnlyTheirExpertAndZeroFactorsNothing) {
  const std::vector<float> zero_u(kE * kD * kR, 0.0f), zero_v(kE * kR * kI, 0.0f), no_slot(0);
  const std::vector<std::int32_t> two_bit(kE, -1), expert1_in_slot = {-1, 0, -1, -1};
  EXPECT_EQ(Run(1, two_bit, zero_u, zero_v, no_slot), RunPlain(1, two_bit));
  EXPECT_EQ(Run(1, expert1_in_slot, zero_u, zero_v, no_slot), RunPlain(1, expert1_in_slot));
  // Factors for expert 1 only.
  std::vector<float> u = zero_u, v = zero_v;
  for (std::int64_t k = 0; k < kD * kR; ++k) u[1 * kD * kR + k] = 0.1f * static_cast<float>(k % 7 - 3);
  for (std::int64_t k = 0; k < kR * kI; ++k) v[1 * kR * kI + k] = 0.1f * static_cast<float>(k % 5 - 2);
  EXPECT_NE(Run(1, two_bit, u, v, no_slot), RunPlain(1, two_bit));
  EXPECT_NE(Run(1, expert1_in_slot, u, v, no_slot), RunPlain(1, expert1_in_slot));
  EXPECT_EQ(Run(2, two_bit, u, v, no_slot), RunPlain(2, two_bit));
}

TEST_F(CpuNqMoeLowRank, SlotFactorsApplyOnlyAtFourBits) {
  const std::vector<float> zero_u(kE * kD * kR, 0.0f), zero_v(kE * kR * kI, 0.0f);
  std::vector<float> slot((kD + kI) * kR);
  for (size_t k = 0; k < slot.size(); ++k) slot[k] = 0.125f * static_cast<float>(static_cast<int>(k % 9) - 4);
  const std::vector<std::int32_t> two_bit(kE, -1), expert1_in_slot = {-1, 0, -1, -1};
  EXPECT_NE(Run(1, expert1_in_slot, zero_u, zero_v, slot), RunPlain(1, expert1_in_slot));
  EXPECT_EQ(Run(1, two_bit, zero_u, zero_v, slot), RunPlain(1, two_bit)) << "2 bits read no slot";
}

TEST_F(CpuNqMoeLowRank, RefusesInconsistentFactorsByName) {
  testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu_, host_, std::vector<std::int32_t>{-1, 0, -1, -1});
  Tensor tx = Upload(*cpu_, x_, DType::kF32, {1, kD});
  Tensor ids = UploadI32(*cpu_, std::vector<std::int32_t>{1}, {1, 1});
  Tensor weights = Upload(*cpu_, std::vector<float>{1.0f}, DType::kF32, {1, 1});
  absl::StatusOr<Tensor> out = cpu_->Allocate(DType::kF32, Shape{1, kD});
  ASSERT_TRUE(out.ok());
  layer.weights.down.lowrank_u = Upload(*cpu_, std::vector<float>(kE * kD * kR, 0.0f), DType::kF32, {kE, kD, kR});
  layer.weights.down.lowrank_v = Upload(*cpu_, std::vector<float>(kE * kR * kI, 0.0f), DType::kF32, {kE, kR, kI});
  layer.weights.down.lowrank_offset = 0;
  EXPECT_THAT(cpu_->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lowrank_rank is 0")));
  layer.weights.lowrank_rank = 3;
  EXPECT_THAT(cpu_->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("down.lowrank_u is")));
  layer.weights.lowrank_rank = kR;
  layer.weights.down.lowrank_offset = layer.slots.slot_bytes - 2;
  EXPECT_THAT(cpu_->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("low-rank factors at offset")));
  layer.weights.lowrank_rank = 5;
  EXPECT_THAT(cpu_->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lowrank_rank 5")));
}

TEST(CpuNqMoeLowRankFixture, FactorsOnEveryProjectionMatchTheDenseReferenceAndMatter) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4205);
  constexpr std::int64_t kDim = 64, kInter = 32, kExperts = 6, kTopK = 3, kTokens = 4;
  for (const NqCodec codec : {NqCodec::kNestedScalar, NqCodec::kTrellis}) {
    const testing::NqMoeHost plain = codec == NqCodec::kTrellis
                                         ? testing::RandomTrellisNqMoe(rng, kDim, kInter, kExperts)
                                         : testing::RandomNqMoe(rng, kDim, kInter, kExperts);
    testing::NqMoeHost corrected = plain;
    testing::AddRandomLowRank(rng, corrected, 3, /*gate_up=*/true, /*down=*/true);
    const std::vector<float> x = RandomNormal(rng, kTokens * kDim, 1.0f);
    const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, kTokens, kTopK, kExperts, kExperts);
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(absl::StrCat("codec ", static_cast<int>(codec), " mode ", mode));
      const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, kExperts, mode);
      const std::vector<float> got = testing::RunNqMoe(*cpu, corrected, slots, x, routing, kTopK);
      const std::vector<double> want =
          testing::DenseNqMoeReference(corrected, x, routing.ids, routing.weights, kTopK, slots);
      EXPECT_LT(NormalizedError(got, want), 1e-5);
      // The corrections are large enough that a backend that dropped or misplaced them fails the
      // CUDA tests' 2e-3 tolerance many times over.
      const std::vector<float> without = testing::RunNqMoe(*cpu, plain, slots, x, routing, kTopK);
      EXPECT_GT(NormalizedError(without, want), 0.05);
    }
  }
}

}  // namespace
}  // namespace nq::kernels
