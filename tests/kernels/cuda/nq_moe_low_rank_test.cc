// CUDA NqMoe with low-rank corrections (issue #16; nq_moe_low_rank.cuh) against the CPU backend's
// (itself checked against the fixture's dense reference in cpu/nq_moe_low_rank_test.cc), through
// every CUDA path: the decode GEMVs (register slots at whole 256-input steps, the ring otherwise,
// trellis_v1's), the grouped prefill and the dense (cuBLAS) prefill; every expert at 2 bits, at
// 4 bits (the slot's factors too) and a random mix; factors on gate and up, on down, on all
// three; ranks 1 to 4; slots scattered over memory. Each case first checks that its corrections
// move the CPU result far past the tolerance, so a path that dropped them would fail.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/nq_moe_fixture.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomNormal;

constexpr double kTolerance = 2e-3;  // of the largest output, as CudaNqMoe's

TEST(CudaNqMoeLowRank, MatchesCpuOnEveryPath) {
  if (Backends().cuda == nullptr) return;
  ASSERT_TRUE(Backends().cuda->AppliesNqLowRank());
  std::mt19937_64 rng = MakeRng(4306);
  ErrorSummary summary("NqMoe with low-rank corrections", kTolerance);
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  struct Case {
    NqCodec codec;
    std::int64_t hidden, intermediate, experts, top_k, tokens, rank;
    bool gate_up, down, scattered;
  };
  // 1-7 tokens: the decode GEMVs (2048 x 1536: register slots; 320 x 48: rows ending mid-step,
  // the ring); 64: the grouped prefill; 64 x 32 with 4 experts at 256 tokens: the dense prefill.
  for (const Case c : {Case{NqCodec::kNestedScalar, 256, 64, 12, 4, 1, 4, true, true, false},
                       Case{NqCodec::kNestedScalar, 256, 64, 12, 4, 4, 2, true, false, false},
                       Case{NqCodec::kNestedScalar, 256, 64, 12, 4, 7, 3, false, true, true},
                       Case{NqCodec::kNestedScalar, 320, 48, 12, 3, 3, 1, true, true, false},
                       Case{NqCodec::kNestedScalar, 2048, 1536, 8, 4, 1, 4, true, true, false},
                       Case{NqCodec::kNestedScalar, 1024, 256, 16, 4, 4, 2, true, true, true},
                       Case{NqCodec::kNestedScalar, 256, 64, 16, 4, 64, 3, true, true, false},
                       Case{NqCodec::kNestedScalar, 256, 64, 16, 4, 64, 2, false, true, true},
                       Case{NqCodec::kNestedScalar, 64, 32, 4, 2, 256, 4, true, true, false},
                       Case{NqCodec::kNestedScalar, 64, 32, 4, 2, 256, 1, true, false, true},
                       Case{NqCodec::kTrellis, 256, 128, 16, 4, 2, 4, true, true, false},
                       Case{NqCodec::kTrellis, 256, 128, 16, 4, 64, 2, true, true, true},
                       Case{NqCodec::kTrellis, 64, 32, 4, 2, 256, 3, true, true, false}}) {
    if (small && c.hidden > 320) continue;
    const testing::NqMoeHost plain = c.codec == NqCodec::kTrellis
                                         ? testing::RandomTrellisNqMoe(rng, c.hidden, c.intermediate, c.experts)
                                         : testing::RandomNqMoe(rng, c.hidden, c.intermediate, c.experts);
    testing::NqMoeHost corrected = plain;
    testing::AddRandomLowRank(rng, corrected, c.rank, c.gate_up, c.down);
    const std::vector<float> x = RandomNormal(rng, c.tokens * c.hidden, 1.0f);
    const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, c.tokens, c.top_k, c.experts, 2 * c.top_k);
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(absl::StrCat("codec ", static_cast<int>(c.codec), " D ", c.hidden, " I ", c.intermediate, " T ",
                                c.tokens, " R ", c.rank, c.gate_up ? " gate_up" : "", c.down ? " down" : "",
                                c.scattered ? " scattered" : "", " mode ", mode));
      const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, c.experts, mode);
      const std::vector<float> want = testing::RunNqMoe(*Backends().cpu, corrected, slots, x, routing, c.top_k);
      const std::vector<float> without = testing::RunNqMoe(*Backends().cpu, plain, slots, x, routing, c.top_k);
      EXPECT_GT(NormalizedError(without, want), 10 * kTolerance) << "the corrections must matter in this case";
      const std::vector<float> got =
          testing::RunNqMoe(*Backends().cuda, corrected, slots, x, routing, c.top_k, c.scattered);
      summary.Add(NormalizedError(got, want));
    }
  }
}

// The decode path keeps each token's rotated input from its first assignment's blocks: an invalid
// first expert id (the kernels skip such assignments) must not leave the token's other experts
// uncorrected. The CPU op refuses invalid ids, so its oracle names an unused expert at weight 0.
TEST(CudaNqMoeLowRank, AnInvalidFirstExpertLeavesTheTokensOthersCorrected) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4307);
  ErrorSummary summary("NqMoe with low-rank corrections, invalid first ids", kTolerance);
  constexpr std::int64_t kDim = 256, kInter = 64, kExperts = 12, kTopK = 4;
  testing::NqMoeHost host = testing::RandomNqMoe(rng, kDim, kInter, kExperts);
  testing::AddRandomLowRank(rng, host, 2, /*gate_up=*/true, /*down=*/true);
  for (const std::int64_t tokens : {1, 4, 64}) {
    const std::vector<float> x = RandomNormal(rng, tokens * kDim, 1.0f);
    // Experts drawn from the first 2K only, so expert kExperts - 1 is never routed: the oracle's
    // stand-in for the invalid id.
    const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, tokens, kTopK, kExperts, 2 * kTopK);
    testing::NqMoeRouting invalid = routing, oracle = routing;
    for (std::int64_t t = 0; t < tokens; ++t) {
      invalid.ids[t * kTopK] = -1;
      oracle.ids[t * kTopK] = static_cast<std::int32_t>(kExperts - 1);
      oracle.weights[t * kTopK] = 0.0f;
    }
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(absl::StrCat("T ", tokens, " mode ", mode));
      const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, kExperts, mode);
      const std::vector<float> want = testing::RunNqMoe(*Backends().cpu, host, slots, x, oracle, kTopK);
      const std::vector<float> got = testing::RunNqMoe(*Backends().cuda, host, slots, x, invalid, kTopK);
      summary.Add(NormalizedError(got, want));
    }
  }
}

}  // namespace
}  // namespace nq::kernels
