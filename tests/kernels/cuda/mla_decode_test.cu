// The split MLA kernels' plan and refusals (kernels/cuda/mla_decode.cuh), and any split count
// (splits without keys included) against one split; their results against the CPU backend are in
// mla_attention_test.cc.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/mla_decode.cuh"
#include "kernels/dtype.h"

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

// Device memory freed at scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  template <typename T>
  void Upload(const std::vector<T>& v) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
};

std::vector<float> Normal(std::mt19937_64& rng, std::size_t n, float sd) {
  std::normal_distribution<float> normal(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<std::uint16_t> Bf16Bits(const std::vector<float>& v) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = ToBf16(v[i]).bits;
  return out;
}

// The same inputs split 8, 64 and 256 ways (at 300 keys, most of 256 splits have no key tile)
// against one split (no merge at all), on an fp32 and a BF16 cache.
TEST(CudaMlaDecode, AnySplitCountGivesTheOneSplitResult) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no GPU";
  int num_sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Shape {
    int tokens, heads, keys;
  };
  std::mt19937_64 rng(20261206);
  for (const Shape& s : {Shape{1, 16, 2000}, Shape{3, 20, 300}, Shape{2, 64, 700}}) {
    for (DType kv_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(absl::StrCat("T=", s.tokens, " H=", s.heads, " keys=", s.keys, " cache ", DTypeName(kv_dtype)));
      MlaAttentionParams p = Dsv3(s.tokens, s.heads, s.keys);
      p.kv_dtype = kv_dtype;
      const std::size_t kv_bytes = kv_dtype == DType::kF32 ? 4 : 2;
      DeviceBuffer q_nope(sizeof(float) * s.tokens * s.heads * p.dn), q_pe(sizeof(float) * s.tokens * s.heads * p.dr);
      DeviceBuffer latent(kv_bytes * s.keys * p.c), rope(kv_bytes * s.keys * p.dr);
      DeviceBuffer w_uk(2 * std::size_t{1} * s.heads * p.dn * p.c), w_uv(2 * std::size_t{1} * s.heads * p.dv * p.c);
      DeviceBuffer out(sizeof(float) * s.tokens * s.heads * p.dv);
      q_nope.Upload(Normal(rng, std::size_t{1} * s.tokens * s.heads * p.dn, 1.0f));
      q_pe.Upload(Normal(rng, std::size_t{1} * s.tokens * s.heads * p.dr, 1.0f));
      const std::vector<float> kv = Normal(rng, std::size_t{1} * s.keys * p.c, 1.0f);
      const std::vector<float> pe = Normal(rng, std::size_t{1} * s.keys * p.dr, 1.0f);
      if (kv_dtype == DType::kF32) {
        latent.Upload(kv);
        rope.Upload(pe);
      } else {
        latent.Upload(Bf16Bits(kv));
        rope.Upload(Bf16Bits(pe));
      }
      w_uk.Upload(Bf16Bits(Normal(rng, std::size_t{1} * s.heads * p.dn * p.c, 0.05f)));
      w_uv.Upload(Bf16Bits(Normal(rng, std::size_t{1} * s.heads * p.dv * p.c, 0.05f)));
      p.q_nope = static_cast<const float*>(q_nope.p);
      p.q_pe = static_cast<const float*>(q_pe.p);
      p.kv_latent = latent.p;
      p.k_pe = rope.p;
      p.w_uk = w_uk.p;
      p.w_uv = w_uv.p;
      p.out = static_cast<float*>(out.p);
      p.scale = 1.0f / std::sqrt(static_cast<float>(p.dn + p.dr));
      ASSERT_TRUE(MlaDecodeApplies(p));

      auto run = [&](const MlaDecodePlan& plan) {
        DeviceBuffer scratch(plan.ScratchBytes());
        EXPECT_EQ(cudaMemset(out.p, 0xff, sizeof(float) * s.tokens * s.heads * p.dv), cudaSuccess);  // NaNs
        const absl::Status launched = LaunchMlaDecode(p, plan, scratch.p, plan.ScratchBytes(), {.num_sms = num_sms});
        EXPECT_TRUE(launched.ok()) << launched;
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<float> host(std::size_t{1} * s.tokens * s.heads * p.dv);
        EXPECT_EQ(cudaMemcpy(host.data(), out.p, host.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        return host;
      };
      const MlaDecodePlan one = PlanMlaDecode(p, num_sms, 1);
      ASSERT_EQ(one.splits, 1);
      const std::vector<float> expected = run(one);
      float largest = 0.0f;
      for (float v : expected) largest = std::max(largest, std::abs(v));
      ASSERT_TRUE(std::isfinite(largest));
      ASSERT_GT(largest, 0.0f);
      for (int splits : {8, 64, 256}) {
        const MlaDecodePlan plan = PlanMlaDecode(p, num_sms, splits);
        SCOPED_TRACE(absl::StrCat("splits ", plan.splits));
        ASSERT_EQ(plan.splits, splits);
        const std::vector<float> got = run(plan);
        float worst = 0.0f;
        for (std::size_t i = 0; i < got.size(); ++i) {
          const float d = std::abs(got[i] - expected[i]);
          worst = std::isnan(d) ? INFINITY : std::max(worst, d);
        }
        EXPECT_LE(worst, 2e-5f * largest);
      }
    }
  }
}

}  // namespace
}  // namespace nq::kernels::cuda
