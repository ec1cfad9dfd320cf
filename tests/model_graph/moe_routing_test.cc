#include "services/model/moe_routing.h"

#include <cmath>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::model {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

float Logit(float p) { return std::log(p / (1 - p)); }  // sigmoid(Logit(p)) == p

TEST(MoeRoutingTest, TopKWithNormalisationAndScaling) {
  const std::vector<float> logits = {Logit(0.1f), Logit(0.9f), Logit(0.3f), Logit(0.6f)};
  absl::StatusOr<MoeRouting> r = RouteTokens(logits, {}, {.num_experts = 4, .top_k = 2, .routed_scaling_factor = 2.5f});
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(r->experts, ElementsAre(1, 3));
  EXPECT_NEAR(r->weights[0], 0.9 / 1.5 * 2.5, 1e-5);
  EXPECT_NEAR(r->weights[1], 0.6 / 1.5 * 2.5, 1e-5);
}

TEST(MoeRoutingTest, BiasChoosesButDoesNotWeigh) {
  const std::vector<float> logits = {Logit(0.1f), Logit(0.9f), Logit(0.3f), Logit(0.6f)};
  const std::vector<float> bias = {0.85f, 0, 0, 0};  // expert 0 now beats expert 3 (0.95 > 0.6)
  absl::StatusOr<MoeRouting> r =
      RouteTokens(logits, bias, {.num_experts = 4, .top_k = 2, .norm_topk_prob = false});
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(r->experts, ElementsAre(0, 1));
  EXPECT_NEAR(r->weights[0], 0.1, 1e-6) << "weights use the unbiased score";
  EXPECT_NEAR(r->weights[1], 0.9, 1e-6);
}

TEST(MoeRoutingTest, GroupLimitedSelection) {
  // Groups {0,1} {2,3} {4,5}; group scores (sum of top 2): 0.5+0.5, 0.95+0.05, 0.6+0.6.
  const std::vector<float> p = {0.5f, 0.5f, 0.95f, 0.05f, 0.6f, 0.6f};
  std::vector<float> logits;
  for (float v : p) logits.push_back(Logit(v));
  absl::StatusOr<MoeRouting> r = RouteTokens(logits, {}, {.num_experts = 6, .top_k = 2, .n_group = 3, .topk_group = 1});
  ASSERT_THAT(r, IsOk());
  // Only group 2 survives although expert 2 has the best single score.
  EXPECT_THAT(r->experts, ElementsAre(4, 5));
}

TEST(MoeRoutingTest, SeveralTokens) {
  const std::vector<float> logits = {Logit(0.2f), Logit(0.8f), Logit(0.7f), Logit(0.1f)};
  absl::StatusOr<MoeRouting> r = RouteTokens(logits, {}, {.num_experts = 2, .top_k = 1});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->num_tokens, 2);
  EXPECT_THAT(r->experts, ElementsAre(1, 0));
  EXPECT_THAT(r->weights, ElementsAre(1.0f, 1.0f));
}

TEST(MoeRoutingTest, RejectsBadParameters) {
  const std::vector<float> logits(8, 0.0f);
  EXPECT_THAT(RouteTokens(logits, {}, {.num_experts = 4, .top_k = 5}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k 5 of 4")));
  EXPECT_THAT(RouteTokens(logits, {}, {.num_experts = 4, .top_k = 1, .n_group = 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("groups")));
  EXPECT_THAT(RouteTokens(logits, {}, {.num_experts = 3, .top_k = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a multiple")));
  EXPECT_THAT(RouteTokens(logits, std::vector<float>(3), {.num_experts = 4, .top_k = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bias")));
}

}  // namespace
}  // namespace nq::model
