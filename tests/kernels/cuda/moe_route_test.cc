// CUDA MoeRoute vs the CPU backend: the same experts in the same order (ties included: integer
// logits make many exactly equal scores, which both order by expert id), weights to a few ulps
// (the GPU's expf and the host's exp may differ in the last bit).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
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
using ::nq::kernels::testing::DownloadI32;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;

TEST(CudaMoeRoute, MatchesCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4402);
  struct Case {
    const char* name;
    MoeRouteParams p;
    bool bias;
  };
  const std::vector<Case> cases = {
      {"DeepSeek-V3", {.num_experts = 256, .top_k = 8, .n_group = 8, .topk_group = 4, .norm_topk_prob = true,
                       .routed_scaling_factor = 2.5f}, true},
      {"GLM-5", {.num_experts = 256, .top_k = 8, .n_group = 1, .topk_group = 1, .norm_topk_prob = true,
                 .routed_scaling_factor = 2.5f}, true},
      {"nano", {.num_experts = 32, .top_k = 4, .n_group = 1, .topk_group = 1, .norm_topk_prob = true,
                .routed_scaling_factor = 1.0f}, true},
      {"odd", {.num_experts = 72, .top_k = 5, .n_group = 6, .topk_group = 2, .norm_topk_prob = false,
               .routed_scaling_factor = 0.75f}, false},
      {"wide", {.num_experts = 1024, .top_k = 16, .n_group = 64, .topk_group = 8, .norm_topk_prob = true,
                .routed_scaling_factor = 1.0f}, true},
  };
  for (const Case& c : cases) {
    for (bool integer_logits : {false, true}) {
      for (std::int64_t T : {1, 4, 300}) {
        SCOPED_TRACE(absl::StrCat(c.name, " T=", T, integer_logits ? " integer logits (ties)" : ""));
        const int E = c.p.num_experts, K = c.p.top_k;
        std::vector<float> logits = RandomNormal(rng, T * E, 2.0f);
        if (integer_logits) {
          for (float& v : logits) v = static_cast<float>(RandomInt(rng, -3, 3));
        }
        // Integer logits with no bias: whole runs of equal choice and group scores.
        std::vector<float> bias = RandomNormal(rng, E, 0.05f);
        if (integer_logits) std::fill(bias.begin(), bias.end(), 0.0f);
        std::vector<std::int32_t> ids[2];
        std::vector<float> weights[2];
        int i = 0;
        for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
          Tensor l = Upload(*backend, logits, DType::kF32, {T, E});
          Tensor b = Upload(*backend, bias, DType::kF32, {E});
          Tensor id = AllocateOrFail(*backend, DType::kI32, {T, K});
          Tensor w = AllocateOrFail(*backend, DType::kF32, {T, K});
          NQ_ASSERT_OK(backend->MoeRoute(l, c.bias ? &b : nullptr, c.p, id, w));
          ids[i] = DownloadI32(*backend, id);
          weights[i++] = Download(*backend, w);
        }
        EXPECT_EQ(ids[1], ids[0]);
        for (size_t j = 0; j < weights[0].size(); ++j) {
          ASSERT_NEAR(weights[1][j], weights[0][j], 1e-6f * std::max(1.0f, std::abs(weights[0][j]))) << "entry " << j;
        }
      }
    }
  }
}

// A NaN router logit ranks below every number (the host's sort has no order for it): the
// choices are the CPU's with those experts' logits at -1e30 (score 0, below every other score
// without a bias), in the same order and with the same weights, and never a NaN expert.
TEST(CudaMoeRoute, NanScoresRankBelowEveryNumber) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4404);
  const MoeRouteParams p{.num_experts = 256, .top_k = 8, .n_group = 1, .topk_group = 1, .norm_topk_prob = true,
                         .routed_scaling_factor = 2.5f};
  const std::int64_t T = 4;
  std::vector<float> logits = RandomNormal(rng, T * p.num_experts, 2.0f);
  std::vector<float> finite = logits;
  for (std::int64_t i = 0; i < T * p.num_experts; i += 7) {
    logits[i] = std::nanf("");
    finite[i] = -1e30f;
  }
  // One token's largest logit made NaN, so its best expert would otherwise be a NaN one.
  const auto top = std::max_element(logits.begin() + p.num_experts, logits.begin() + 2 * p.num_experts);
  *top = std::nanf("");
  finite[top - logits.begin()] = -1e30f;
  std::vector<std::int32_t> ids[2];
  std::vector<float> weights[2];
  int i = 0;
  for (auto [backend, values] : {std::pair(Backends().cpu.get(), &finite), std::pair(Backends().cuda.get(), &logits)}) {
    Tensor l = Upload(*backend, *values, DType::kF32, {T, p.num_experts});
    Tensor id = AllocateOrFail(*backend, DType::kI32, {T, p.top_k});
    Tensor w = AllocateOrFail(*backend, DType::kF32, {T, p.top_k});
    NQ_ASSERT_OK(backend->MoeRoute(l, nullptr, p, id, w));
    ids[i] = DownloadI32(*backend, id);
    weights[i++] = Download(*backend, w);
  }
  EXPECT_EQ(ids[1], ids[0]);
  for (size_t j = 0; j < ids[1].size(); ++j) {
    EXPECT_FALSE(std::isnan(logits[(j / p.top_k) * p.num_experts + ids[1][j]])) << "choice " << j;
    ASSERT_NEAR(weights[1][j], weights[0][j], 1e-6f * std::max(1.0f, std::abs(weights[0][j]))) << "entry " << j;
  }
}

// One decode token's routing at DeepSeek-V3's and GLM-5's shapes, launches back to back (the
// step graph launches it once per MoE layer).
TEST(CudaMoeRoute, Timing) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(4403);
  const std::vector<std::pair<const char*, MoeRouteParams>> shapes = {
      {"DeepSeek-V3", {.num_experts = 256, .top_k = 8, .n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5f}},
      {"GLM-5", {.num_experts = 256, .top_k = 8, .n_group = 1, .topk_group = 1, .routed_scaling_factor = 2.5f}},
  };
  for (const auto& [name, p] : shapes) {
    Tensor l = Upload(cuda, RandomNormal(rng, p.num_experts, 2.0f), DType::kF32, {1, p.num_experts});
    Tensor b = Upload(cuda, RandomNormal(rng, p.num_experts, 0.05f), DType::kF32, {p.num_experts});
    Tensor id = AllocateOrFail(cuda, DType::kI32, {1, p.top_k});
    Tensor w = AllocateOrFail(cuda, DType::kF32, {1, p.top_k});
    NQ_ASSERT_OK(cuda.MoeRoute(l, &b, p, id, w));
    NQ_ASSERT_OK(cuda.Synchronize());
    constexpr int kRuns = 1000;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kRuns; ++i) NQ_ASSERT_OK(cuda.MoeRoute(l, &b, p, id, w));
    NQ_ASSERT_OK(cuda.Synchronize());
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / kRuns;
    std::printf("[ timing   ] MoeRoute %s, 1 token: %.2f us per launch (back to back)\n", name, us);
  }
}

TEST(CudaCopyToHostAsync, LandsInPinnedStagingByTheNextCopy) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(4403);
  const std::vector<float> values = RandomNormal(rng, 4096, 1.0f);
  Tensor t = Upload(cuda, values, DType::kF32, {4096});
  absl::StatusOr<std::unique_ptr<Storage>> staging = cuda.AllocateHostStaging(4096 * sizeof(float));
  NQ_ASSERT_OK(staging.status());
  NQ_ASSERT_OK(cuda.CopyToHostAsync(t, std::span<std::byte>(static_cast<std::byte*>((*staging)->data()), 4096 * 4)));
  // A later synchronous copy waits for the stream, so the async one has landed by then.
  EXPECT_EQ(Download(cuda, t), values);
  EXPECT_EQ(std::memcmp((*staging)->data(), values.data(), 4096 * sizeof(float)), 0);
}

}  // namespace
}  // namespace nq::kernels
