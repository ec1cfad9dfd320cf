// The CPU NqMoe op (the oracle of the CUDA kernels) against a dense reference that takes a
// different road: every expert dequantised and unrotated into dense matrices, rotations as
// dense Hadamard matrices, in double. And the op's argument checks.
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

TEST(CpuNqMoe, MatchesTheDenseReferenceAtTwoFourAndMixedBits) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4201);
  constexpr std::int64_t kD = 64, kI = 32, kE = 8, kK = 3, kT = 5;
  const testing::NqMoeHost host = testing::RandomNqMoe(rng, kD, kI, kE);
  const std::vector<float> x = RandomNormal(rng, kT * kD, 1.0f);
  const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, kT, kK, kE, kE);
  const std::vector<std::vector<std::int32_t>> precisions = {
      std::vector<std::int32_t>(kE, -1), {0, 1, 2, 3, 4, 5, 6, 7}, {-1, 0, -1, 1, 2, -1, -1, 3}};
  for (const std::vector<std::int32_t>& slots : precisions) {
    testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu, host, slots);
    Tensor tx = Upload(*cpu, x, DType::kF32, {kT, kD});
    Tensor ids = UploadI32(*cpu, routing.ids, {kT, kK});
    Tensor weights = Upload(*cpu, routing.weights, DType::kF32, {kT, kK});
    absl::StatusOr<Tensor> out = cpu->Allocate(DType::kF32, Shape{kT, kD});
    ASSERT_TRUE(out.ok());
    NQ_ASSERT_OK(cpu->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out));
    const std::vector<double> want = testing::DenseNqMoeReference(host, x, routing.ids, routing.weights, kK, slots);
    EXPECT_LT(NormalizedError(Download(*cpu, *out), want), 1e-5);
  }
}

TEST(CpuNqMoe, FourBitsChangeTheResultOnlyForExpertsWithASlot) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4202);
  constexpr std::int64_t kD = 32, kI = 16, kE = 4;
  const testing::NqMoeHost host = testing::RandomNqMoe(rng, kD, kI, kE);
  const std::vector<float> x = RandomNormal(rng, kD, 1.0f);
  auto run = [&](std::vector<std::int32_t> slots, std::int32_t expert) {
    testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu, host, slots);
    Tensor tx = Upload(*cpu, x, DType::kF32, {1, kD});
    Tensor ids = UploadI32(*cpu, std::vector<std::int32_t>{expert}, {1, 1});
    Tensor weights = Upload(*cpu, std::vector<float>{1.0f}, DType::kF32, {1, 1});
    absl::StatusOr<Tensor> out = cpu->Allocate(DType::kF32, Shape{1, kD});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return std::vector<float>();
    EXPECT_TRUE(cpu->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out).ok());
    return Download(*cpu, *out);
  };
  // Expert 1 in a slot: its own output moves, expert 2's does not.
  EXPECT_NE(run({-1, -1, -1, -1}, 1), run({-1, 0, -1, -1}, 1));
  EXPECT_EQ(run({-1, -1, -1, -1}, 2), run({-1, 0, -1, -1}, 2));
}

TEST(CpuNqMoe, RefusesBadIdsAndShapesByName) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4203);
  constexpr std::int64_t kD = 32, kI = 16, kE = 4;
  const testing::NqMoeHost host = testing::RandomNqMoe(rng, kD, kI, kE);
  testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu, host, std::vector<std::int32_t>(kE, -1));
  Tensor tx = Upload(*cpu, RandomNormal(rng, 2 * kD, 1.0f), DType::kF32, {2, kD});
  Tensor weights = Upload(*cpu, std::vector<float>{1, 1, 1, 1}, DType::kF32, {2, 2});
  absl::StatusOr<Tensor> out = cpu->Allocate(DType::kF32, Shape{2, kD});
  ASSERT_TRUE(out.ok());
  Tensor out_of_range = UploadI32(*cpu, std::vector<std::int32_t>{0, 1, 2, 4}, {2, 2});
  EXPECT_THAT(cpu->NqMoe(tx, out_of_range, weights, layer.weights, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert id 4")));
  Tensor repeated = UploadI32(*cpu, std::vector<std::int32_t>{0, 1, 3, 3}, {2, 2});
  EXPECT_THAT(cpu->NqMoe(tx, repeated, weights, layer.weights, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names expert 3 twice")));
  Tensor ids = UploadI32(*cpu, std::vector<std::int32_t>{0, 1, 2, 3}, {2, 2});
  NqMoeWeights wrong = std::move(layer.weights);
  wrong.hidden = kD * 2;
  EXPECT_THAT(cpu->NqMoe(tx, ids, weights, wrong, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x is F32[2, 32]")));
  wrong.hidden = kD;
  wrong.down_rows.block = 3;
  EXPECT_THAT(cpu->NqMoe(tx, ids, weights, wrong, layer.slots, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("down_rows.block 3")));
}

// Slots scattered over memory (NqSlots::slot_records, the records a layer-major prefill borrows
// from the free KV cache) give the same result as one arena, bit for bit.
TEST(CpuNqMoe, ScatteredSlotsMatchTheArena) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4204);
  constexpr std::int64_t kD = 64, kI = 32, kE = 8, kK = 3, kT = 6;
  const testing::NqMoeHost host = testing::RandomNqMoe(rng, kD, kI, kE);
  const std::vector<float> x = RandomNormal(rng, kT * kD, 1.0f);
  const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, kT, kK, kE, kE);
  const std::vector<std::int32_t> slots = {3, -1, 0, 2, -1, 1, 4, -1};
  const std::vector<float> arena = testing::RunNqMoe(*cpu, host, slots, x, routing, kK);
  const std::vector<float> scattered = testing::RunNqMoe(*cpu, host, slots, x, routing, kK, /*scattered_slots=*/true);
  ASSERT_EQ(arena.size(), static_cast<size_t>(kT * kD));
  EXPECT_EQ(scattered, arena);
  // And the 4-bit slots were read: all at 2 bits differs.
  EXPECT_NE(testing::RunNqMoe(*cpu, host, std::vector<std::int32_t>(kE, -1), x, routing, kK), arena);
}

TEST(CpuNqMoe, RefusesSlotRecordsOfTheWrongSizeOrWithoutAnArena) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4205);
  constexpr std::int64_t kD = 32, kI = 16, kE = 4;
  const testing::NqMoeHost host = testing::RandomNqMoe(rng, kD, kI, kE);
  testing::NqMoeDevice layer = testing::UploadNqMoe(*cpu, host, std::vector<std::int32_t>{0, 1, -1, -1}, true);
  Tensor tx = Upload(*cpu, RandomNormal(rng, kD, 1.0f), DType::kF32, {1, kD});
  Tensor ids = UploadI32(*cpu, std::vector<std::int32_t>{0}, {1, 1});
  Tensor weights = Upload(*cpu, std::vector<float>{1.0f}, DType::kF32, {1, 1});
  absl::StatusOr<Tensor> out = cpu->Allocate(DType::kF32, Shape{1, kD});
  ASSERT_TRUE(out.ok());
  NQ_ASSERT_OK(cpu->NqMoe(tx, ids, weights, layer.weights, layer.slots, *out));
  NqSlots short_table = layer.slots;
  short_table.num_slots = 3;  // the table holds 2 addresses
  EXPECT_THAT(cpu->NqMoe(tx, ids, weights, layer.weights, short_table, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot_records")));
  NqSlots no_arena = layer.slots;
  no_arena.arena = nullptr;
  EXPECT_THAT(cpu->NqMoe(tx, ids, weights, layer.weights, no_arena, *out),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("without an arena")));
}

}  // namespace
}  // namespace nq::kernels
