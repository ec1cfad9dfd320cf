// Backend::MoeRoute on the CPU backend: the routing of a hand-worked case, agreement with the
// host reference the model's host path uses, every argument check, and the host staging +
// CopyToHostAsync pair the model copies routing through.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/moe_route.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::DownloadI32;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

TEST(MoeRoute, RoutesAHandWorkedTokenThroughGroups) {
  auto backend = MakeCpuBackend();
  // 8 experts in 4 groups of 2, keep the best 2 groups, top 3. Logit 0 -> score 0.5; the bias
  // makes group 3 (experts 6, 7) the best by choice score although its scores are lowest.
  const std::vector<float> logits = {2, 1, -1, -2, 0, 3, -3, -3};
  const std::vector<float> bias = {0, 0, 0, 0, 0, 0, 2, 2};
  const MoeRouteParams p{.num_experts = 8, .top_k = 3, .n_group = 4, .topk_group = 2, .norm_topk_prob = true,
                         .routed_scaling_factor = 2.5f};
  Tensor l = Upload(*backend, logits, DType::kF32, {1, 8});
  Tensor b = Upload(*backend, bias, DType::kF32, {8});
  Tensor ids = AllocateOrFail(*backend, DType::kI32, {1, 3});
  Tensor w = AllocateOrFail(*backend, DType::kF32, {1, 3});
  NQ_ASSERT_OK(backend->MoeRoute(l, &b, p, ids, w));
  // Group scores (top-2 choice sums): g0 = s(2)+s(1) = 1.612, g1 = 0.388, g2 = s(0)+s(3) = 1.453,
  // g3 = 2 * (s(-3) + 2) = 4.095: keep g3 and g0. Choice order: 6, 7 (2.047 each, tie -> 6 first), 0.
  EXPECT_EQ(DownloadI32(*backend, ids), (std::vector<std::int32_t>{6, 7, 0}));
  const double s0 = 1 / (1 + std::exp(-2.0)), s6 = 1 / (1 + std::exp(3.0));
  const double sum = s6 + s6 + s0;
  const std::vector<float> got = Download(*backend, w);
  EXPECT_NEAR(got[0], s6 / sum * 2.5, 1e-6);
  EXPECT_NEAR(got[1], s6 / sum * 2.5, 1e-6);
  EXPECT_NEAR(got[2], s0 / sum * 2.5, 1e-6);
}

TEST(MoeRoute, EqualsTheHostReferenceBitForBit) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4401);
  const MoeRouteParams p{.num_experts = 64, .top_k = 6, .n_group = 8, .topk_group = 3, .norm_topk_prob = false,
                         .routed_scaling_factor = 1.0f};
  const int T = 17;
  const std::vector<float> logits = RandomNormal(rng, T * 64, 2.0f);
  const std::vector<float> bias = RandomNormal(rng, 64, 0.1f);
  std::vector<std::int32_t> want_ids(T * 6);
  std::vector<float> want_w(T * 6);
  RouteTokensHost(logits, bias, p, want_ids, want_w);
  Tensor l = Upload(*backend, logits, DType::kF32, {T, 64});
  Tensor b = Upload(*backend, bias, DType::kF32, {64});
  Tensor ids = AllocateOrFail(*backend, DType::kI32, {T, 6});
  Tensor w = AllocateOrFail(*backend, DType::kF32, {T, 6});
  NQ_ASSERT_OK(backend->MoeRoute(l, &b, p, ids, w));
  EXPECT_EQ(DownloadI32(*backend, ids), want_ids);
  EXPECT_EQ(Download(*backend, w), want_w);
}

TEST(MoeRoute, RefusesBadArguments) {
  auto backend = MakeCpuBackend();
  const MoeRouteParams p{.num_experts = 8, .top_k = 2};
  Tensor l = AllocateOrFail(*backend, DType::kF32, {3, 8});
  Tensor ids = AllocateOrFail(*backend, DType::kI32, {3, 2});
  Tensor w = AllocateOrFail(*backend, DType::kF32, {3, 2});
  Tensor wrong_ids = AllocateOrFail(*backend, DType::kI32, {3, 3});
  Tensor f32_ids = AllocateOrFail(*backend, DType::kF32, {3, 2});
  Tensor bias9 = AllocateOrFail(*backend, DType::kF32, {9});
  EXPECT_THAT(backend->MoeRoute(l, nullptr, {.num_experts = 7, .top_k = 2}, ids, w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("for 7 experts")));
  EXPECT_THAT(backend->MoeRoute(l, nullptr, p, wrong_ids, w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ids")));
  EXPECT_THAT(backend->MoeRoute(l, nullptr, p, f32_ids, w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("I32")));
  EXPECT_THAT(backend->MoeRoute(l, &bias9, p, ids, w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bias")));
  EXPECT_THAT(backend->MoeRoute(l, nullptr, {.num_experts = 8, .top_k = 2, .n_group = 3}, ids, w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("groups")));
  EXPECT_THAT(backend->MoeRoute(l, nullptr, {.num_experts = 8, .top_k = 9}, ids, w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  Tensor huge = AllocateOrFail(*backend, DType::kF32, {1, kMaxRoutedExperts + 1});
  Tensor ids1 = AllocateOrFail(*backend, DType::kI32, {1, 2});
  Tensor w1 = AllocateOrFail(*backend, DType::kF32, {1, 2});
  EXPECT_THAT(backend->MoeRoute(huge, nullptr, {.num_experts = kMaxRoutedExperts + 1, .top_k = 2}, ids1, w1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most")));
}

TEST(CopyToHostAsync, LandsInStagingAndChecksItsSize) {
  auto backend = MakeCpuBackend();
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  Tensor t = Upload(*backend, values, DType::kF32, {3});
  absl::StatusOr<std::unique_ptr<Storage>> staging = backend->AllocateHostStaging(64);
  NQ_ASSERT_OK(staging.status());
  auto* at = static_cast<std::byte*>((*staging)->data());
  NQ_ASSERT_OK(backend->CopyToHostAsync(t, std::span<std::byte>(at + 16, 12)));
  NQ_ASSERT_OK(backend->Synchronize());
  std::vector<float> got(3);
  std::memcpy(got.data(), at + 16, 12);
  EXPECT_EQ(got, values);
  EXPECT_THAT(backend->CopyToHostAsync(t, std::span<std::byte>(at, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes of room")));
}

}  // namespace
}  // namespace nq::kernels
