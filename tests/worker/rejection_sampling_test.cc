// Sampler::Verify: speculative verification must leave the output distribution the target's.
// Statistical tests with fixed seeds on a small vocabulary: a chi-square goodness of fit
// against the target distribution (it fails for a verifier that skips the residual or accepts
// drafts unconditionally: the negative controls below check the statistic can tell).
#include <cmath>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/worker/sampler.h"
#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int kTrials = 60000;
// Chi-square critical value for 5 degrees of freedom at p = 0.001 (6 categories).
constexpr double kChiSquareCritical5 = 20.515;

const std::vector<float> kTargetLogits = {1.0f, 2.5f, 0.2f, -0.5f, 1.8f, 0.9f};
// A draft distribution unlike the target: it over-proposes token 0 and never token 4.
const std::vector<float> kDraftProbs = {0.45f, 0.10f, 0.20f, 0.15f, 0.0f, 0.10f};

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < logits.size(); ++i) z += p[i] = std::exp(logits[i] / temperature);
  for (double& v : p) v /= z;
  return p;
}

double ChiSquare(const std::vector<int>& counts, const std::vector<double>& expected_probs) {
  double chi = 0;
  int n = 0;
  for (int c : counts) n += c;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = expected_probs[i] * n;
    if (e == 0) {
      chi += counts[i] > 0 ? 1e9 : 0;  // a token the target never emits
      continue;
    }
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

SamplingConfig Config(float temperature, uint64_t seed, int top_k = 0, float frequency_penalty = 0) {
  SamplingConfig c;
  c.temperature = temperature;
  c.seed = seed;
  c.top_k = top_k;
  c.frequency_penalty = frequency_penalty;
  return c;
}

int DrawFrom(const std::vector<float>& probs, std::mt19937_64& rng) {
  std::discrete_distribution<int> d(probs.begin(), probs.end());
  return d(rng);
}

struct Outcome {
  std::vector<int> counts = std::vector<int>(6, 0);
  std::vector<int> draft_counts = std::vector<int>(6, 0);  // the drafts themselves
  int accepted = 0;
};

Outcome RunVerifications(const SamplingConfig& config, uint64_t draft_seed) {
  absl::StatusOr<Sampler> sampler = Sampler::Create(config);
  std::mt19937_64 draft_rng(draft_seed);
  Outcome out;
  if (!sampler.ok()) {
    ADD_FAILURE() << sampler.status();
    return out;
  }
  for (int i = 0; i < kTrials; ++i) {
    const int draft = DrawFrom(kDraftProbs, draft_rng);
    absl::StatusOr<Sampler::Verdict> v = sampler->Verify(kTargetLogits, draft, kDraftProbs);
    if (!v.ok()) {
      ADD_FAILURE() << v.status();
      return out;
    }
    ++out.counts[v->token.id];
    ++out.draft_counts[draft];
    out.accepted += v->accepted ? 1 : 0;
    if (v->accepted) {
      EXPECT_EQ(v->token.id, draft);
    }
  }
  return out;
}

TEST(RejectionSamplingTest, VerifiedTokensFollowTheTargetDistribution) {
  const Outcome out = RunVerifications(Config(1.0f, 7), 11);
  const std::vector<double> p = Softmax(kTargetLogits, 1.0);
  EXPECT_LT(ChiSquare(out.counts, p), kChiSquareCritical5);
  // Negative control: the drafts alone (what accepting every draft would emit) fail the same
  // test, so the statistic has the power to catch a wrong verifier.
  EXPECT_GT(ChiSquare(out.draft_counts, p), 100 * kChiSquareCritical5);
  // The acceptance rate is sum_x min(p(x), q(x)) (Leviathan et al., section 3.2).
  double expected_rate = 0;
  for (size_t i = 0; i < p.size(); ++i) expected_rate += std::min<double>(p[i], kDraftProbs[i]);
  EXPECT_NEAR(static_cast<double>(out.accepted) / kTrials, expected_rate, 0.01);
}

TEST(RejectionSamplingTest, PositionKeyedDrawsFollowTheTargetToo) {
  // What the sequence runner uses when it speculates: each token's draws on its own stream.
  SamplingConfig config = Config(1.0f, 17);
  config.position_keyed_draws = true;
  const Outcome out = RunVerifications(config, 19);
  EXPECT_LT(ChiSquare(out.counts, Softmax(kTargetLogits, 1.0)), kChiSquareCritical5);
  // Keyed by position, a sampler's k-th token draws the same whatever came before it.
  absl::StatusOr<Sampler> a = Sampler::Create(config);
  absl::StatusOr<Sampler> b = Sampler::Create(config);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(a->Verify(kTargetLogits, 0, kDraftProbs), IsOk());  // one verification: several draws
  ASSERT_THAT(b->Sample(kTargetLogits), IsOk());                  // one sample: one draw
  for (int i = 0; i < 20; ++i) EXPECT_EQ(a->Sample(kTargetLogits)->id, b->Sample(kTargetLogits)->id) << i;
}

TEST(RejectionSamplingTest, TemperatureAndTopKShapeTheTargetTheSameWay) {
  // top_k = 4 drops tokens 2 and 3; temperature 0.7 sharpens the rest.
  const Outcome out = RunVerifications(Config(0.7f, 3, 4), 5);
  std::vector<float> kept_logits = kTargetLogits;
  kept_logits[2] = kept_logits[3] = -INFINITY;
  const std::vector<double> p = Softmax(kept_logits, 0.7);
  EXPECT_EQ(out.counts[2] + out.counts[3], 0);
  EXPECT_LT(ChiSquare(out.counts, p), kChiSquareCritical5);
}

TEST(RejectionSamplingTest, DeterministicDraftsFollowTheTargetToo) {
  // An empty draft distribution: all mass on the draft (a greedy drafter under sampling).
  absl::StatusOr<Sampler> sampler = Sampler::Create(Config(1.0f, 21));
  ASSERT_THAT(sampler, IsOk());
  std::vector<int> counts(6, 0);
  for (int i = 0; i < kTrials; ++i) {
    absl::StatusOr<Sampler::Verdict> v = sampler->Verify(kTargetLogits, /*draft=*/1, {});
    ASSERT_THAT(v, IsOk());
    ++counts[v->token.id];
  }
  EXPECT_LT(ChiSquare(counts, Softmax(kTargetLogits, 1.0)), kChiSquareCritical5);
}

TEST(RejectionSamplingTest, SeededVerificationIsReproducible) {
  const Outcome a = RunVerifications(Config(1.0f, 99), 1);
  const Outcome b = RunVerifications(Config(1.0f, 99), 1);
  EXPECT_EQ(a.counts, b.counts);
  EXPECT_EQ(a.accepted, b.accepted);
}

TEST(RejectionSamplingTest, GreedyVerificationIsSamplesPickAndCountsForPenalties) {
  absl::StatusOr<Sampler> plain = Sampler::Create(Config(0, 0, 0, 2.0f));
  absl::StatusOr<Sampler> verifying = Sampler::Create(Config(0, 0, 0, 2.0f));
  ASSERT_THAT(plain, IsOk());
  ASSERT_THAT(verifying, IsOk());
  for (int step = 0; step < 6; ++step) {
    absl::StatusOr<SampledToken> expected = plain->Sample(kTargetLogits);
    ASSERT_THAT(expected, IsOk());
    // Draft the right token on even steps, a wrong one on odd steps.
    const int32_t draft = step % 2 == 0 ? expected->id : (expected->id + 1) % 6;
    absl::StatusOr<Sampler::Verdict> v = verifying->Verify(kTargetLogits, draft, {});
    ASSERT_THAT(v, IsOk());
    EXPECT_EQ(v->token.id, expected->id) << step;
    EXPECT_EQ(v->token.logprob, expected->logprob) << step;
    EXPECT_EQ(v->accepted, step % 2 == 0) << step;
  }
}

TEST(RejectionSamplingTest, BadDraftsAreRefused) {
  absl::StatusOr<Sampler> sampler = Sampler::Create(Config(1.0f, 0));
  ASSERT_THAT(sampler, IsOk());
  EXPECT_THAT(sampler->Verify(kTargetLogits, 6, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(sampler->Verify(kTargetLogits, 0, std::vector<float>(3, 0.3f)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("draft distribution over 3")));
  EXPECT_THAT(sampler->Verify(kTargetLogits, 4, kDraftProbs),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no mass")));
}

}  // namespace
}  // namespace nq::worker
