// The split MLA kernels' plan and refusals (kernels/cuda/mla_decode.cuh); their results against
// the CPU backend are in mla_attention_test.cc.
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/mla_decode.cuh"

namespace nq::kernels::cuda {
namespace {

// DeepSeek-V3's dims on fake, aligned device addresses: the plan and the checks never read them.
MlaAttentionParams Dsv3(int tokens, int heads, int keys) {
  alignas(16) static float cache[4];
  return {.q_nope = cache, .q_pe = cache, .kv_latent = cache, .k_pe = cache, .w_uk = cache,
          .w_uk_dtype = DType::kBF16, .w_uv = cache, .w_uv_dtype = DType::kBF16, .out = cache,
          .tokens = tokens, .heads = heads, .dn = 128, .dr = 64, .c = 512, .dv = 128,
          .start_pos = keys - tokens, .scale = 0.07f};
}

TEST(CudaMlaDecode, AppliesToDecodeShapesOnly) {
  EXPECT_TRUE(MlaDecodeApplies(Dsv3(1, 16, 4096)));
  EXPECT_TRUE(MlaDecodeApplies(Dsv3(kMlaDecodeMaxTokens, 128, 4096)));
  EXPECT_FALSE(MlaDecodeApplies(Dsv3(kMlaDecodeMaxTokens + 1, 16, 4096)));
  MlaAttentionParams p = Dsv3(1, 16, 100);
  p.c = 40;  // not a multiple of 16
  EXPECT_FALSE(MlaDecodeApplies(p));
  p = Dsv3(1, 16, 100);
  p.c = kMlaMaxLatent + 16;
  EXPECT_FALSE(MlaDecodeApplies(p));
  p = Dsv3(1, 16, 100);
  p.dr = 8;
  EXPECT_FALSE(MlaDecodeApplies(p));
  p = Dsv3(1, 16, 100);
  p.w_uv_dtype = DType::kF16;
  EXPECT_FALSE(MlaDecodeApplies(p));
  p = Dsv3(1, 16, 100);
  p.kv_latent = reinterpret_cast<const float*>(reinterpret_cast<std::uintptr_t>(p.kv_latent) + 4);
  EXPECT_FALSE(MlaDecodeApplies(p));
}

TEST(CudaMlaDecode, PlanGivesEverySmABlockAndEverySplitKeys) {
  // 4096 keys are 128 tiles of 32: one a split, though 132 SMs would take more.
  EXPECT_EQ(PlanMlaDecode(Dsv3(1, 16, 4096), 132).splits, 128);
  EXPECT_EQ(PlanMlaDecode(Dsv3(1, 16, 32768), 132).splits, 132);
  EXPECT_EQ(PlanMlaDecode(Dsv3(4, 16, 32768), 132).splits, 33);
  EXPECT_EQ(PlanMlaDecode(Dsv3(1, 128, 32768), 132).splits, 16);  // 8 head groups
  EXPECT_EQ(PlanMlaDecode(Dsv3(1, 16, 10), 132).splits, 1);
  EXPECT_EQ(PlanMlaDecode(Dsv3(1, 16, 4096), 132, 1000).splits, kMlaMaxSplits);
  const MlaDecodePlan plan = PlanMlaDecode(Dsv3(2, 20, 4096), 132);
  EXPECT_EQ(plan.head_groups, 2);
  // Partials: tokens x groups x splits x 16 rows of c floats.
  EXPECT_GE(plan.partial_bytes, std::size_t{2} * 2 * plan.splits * 16 * 512 * 4);
  EXPECT_GE(plan.o_bytes, std::size_t{2} * 20 * 512 * 4);
  EXPECT_EQ(plan.ScratchBytes(), plan.q_bytes + plan.partial_bytes + 2 * plan.stats_bytes + plan.o_bytes);
}

TEST(CudaMlaDecode, RefusesShapesAndShortScratch) {
  const MlaAttentionParams p = Dsv3(1, 16, 4096);
  const MlaDecodePlan plan = PlanMlaDecode(p, 132);
  std::vector<float> host(16);
  EXPECT_EQ(LaunchMlaDecode(p, plan, nullptr, plan.ScratchBytes(), {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchMlaDecode(p, plan, host.data(), plan.ScratchBytes() - 1, {}).code(),
            absl::StatusCode::kInvalidArgument);
  MlaDecodePlan other = plan;
  other.head_groups = 2;  // a plan made for other shapes
  EXPECT_EQ(LaunchMlaDecode(p, other, host.data(), plan.ScratchBytes(), {}).code(),
            absl::StatusCode::kInvalidArgument);
  MlaAttentionParams wide = p;
  wide.tokens = kMlaDecodeMaxTokens + 1;
  EXPECT_EQ(LaunchMlaDecode(wide, plan, host.data(), plan.ScratchBytes(), {}).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nq::kernels::cuda
