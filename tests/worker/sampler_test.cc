#include "services/worker/sampler.h"

#include <cmath>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

const std::vector<float> kLogits = {0.0f, 2.0f, 1.0f, -1.0f, 1.5f};

TEST(SamplerTest, GreedyPicksTheArgmaxWithItsLogprob) {
  absl::StatusOr<Sampler> s = Sampler::Create({.temperature = 0, .top_logprobs = 2});
  ASSERT_THAT(s, IsOk());
  absl::StatusOr<SampledToken> t = s->Sample(kLogits);
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(t->id, 1);
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  EXPECT_NEAR(t->logprob, 2.0 - std::log(z), 1e-5);
  ASSERT_EQ(t->top.size(), 2u);
  EXPECT_EQ(t->top[0].first, 1);
  EXPECT_EQ(t->top[1].first, 4);
}

TEST(SamplerTest, SeededSamplingIsReproducibleAndFollowsTheDistribution) {
  std::map<int, int> counts;
  std::vector<int> first_run;
  for (int run = 0; run < 2; ++run) {
    absl::StatusOr<Sampler> s = Sampler::Create({.temperature = 1.0f, .seed = 99});
    ASSERT_THAT(s, IsOk());
    for (int i = 0; i < 4000; ++i) {
      const int id = s->Sample(kLogits)->id;
      if (run == 0) {
        first_run.push_back(id);
        ++counts[id];
      } else {
        ASSERT_EQ(id, first_run[i]) << "same seed, same tokens";
      }
    }
  }
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  for (int id = 0; id < 5; ++id) {
    EXPECT_NEAR(counts[id] / 4000.0, std::exp(kLogits[id]) / z, 0.03) << id;
  }
}

TEST(SamplerTest, TopKAndTopPTruncate) {
  absl::StatusOr<Sampler> k = Sampler::Create({.temperature = 1.0f, .top_k = 2, .seed = 1});
  absl::StatusOr<Sampler> p = Sampler::Create({.temperature = 1.0f, .top_p = 0.5f, .seed = 1});
  ASSERT_THAT(k, IsOk());
  ASSERT_THAT(p, IsOk());
  for (int i = 0; i < 500; ++i) {
    const int a = k->Sample(kLogits)->id;
    EXPECT_TRUE(a == 1 || a == 4) << a;
    // p(1) = 0.43 < 0.5, so the nucleus is {1, 4}.
    const int b = p->Sample(kLogits)->id;
    EXPECT_TRUE(b == 1 || b == 4) << b;
  }
}

TEST(SamplerTest, RejectsBadConfigsAndRows) {
  EXPECT_THAT(Sampler::Create({.temperature = -1}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("temperature")));
  EXPECT_THAT(Sampler::Create({.top_p = 0}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p")));
  EXPECT_THAT(Sampler::Create({.top_k = -2}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  EXPECT_THAT(Sampler::Create({.top_logprobs = 21}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_logprobs")));
  absl::StatusOr<Sampler> s = Sampler::Create({});
  const std::vector<float> nans = {NAN, -INFINITY};
  EXPECT_THAT(s->Sample(nans), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no finite")));
}

}  // namespace
}  // namespace nq::worker
