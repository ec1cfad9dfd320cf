#include "services/worker/sampler.h"

#include <cmath>
#include <algorithm>
#include <map>
#include <numeric>
#include <limits>
#include <optional>
#include <random>
#include <set>

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

// Greedy without log-probabilities takes the argmax alone (no softmax over the vocabulary): the
// same token as the full path on every row (ties to the lower id, non-finite logits as -inf,
// with bias and penalties over a sequence), the same verdicts, no logprob; alternatives asked
// for bring the full path back.
TEST(SamplerTest, GreedyWithoutLogprobsPicksWhatTheFullPathPicks) {
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int> small(-3, 3);
  const SamplingConfig base{.temperature = 0, .frequency_penalty = 0.5f, .logit_bias = {{2, 1.0f}}};
  SamplingConfig lean = base;
  lean.logprobs = false;
  absl::StatusOr<Sampler> full = Sampler::Create(base), fast = Sampler::Create(lean);
  ASSERT_THAT(full, IsOk());
  ASSERT_THAT(fast, IsOk());
  for (int row = 0; row < 200; ++row) {
    std::vector<float> logits(64);
    for (float& l : logits) l = static_cast<float>(small(rng));  // many ties
    if (row % 3 == 0) logits[row % 64] = NAN;
    if (row % 5 == 0) logits[(row + 7) % 64] = INFINITY;
    if (row % 7 == 0) logits[(row + 9) % 64] = -INFINITY;
    absl::StatusOr<SampledToken> a = full->Sample(logits), b = fast->Sample(logits);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(b, IsOk());
    ASSERT_EQ(a->id, b->id) << "row " << row;
    EXPECT_EQ(b->logprob, 0.0f);
    EXPECT_TRUE(b->top.empty());
    const int32_t draft = row % 2 == 0 ? a->id : (a->id + 1) % 64;
    absl::StatusOr<Sampler::Verdict> va = full->Verify(logits, draft, {}), vb = fast->Verify(logits, draft, {});
    ASSERT_THAT(va, IsOk());
    ASSERT_THAT(vb, IsOk());
    EXPECT_EQ(va->accepted, vb->accepted);
    EXPECT_EQ(va->token.id, vb->token.id);
  }
  const std::vector<float> none = {NAN, INFINITY, -INFINITY};
  EXPECT_THAT(fast->Sample(none), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no finite")));

  SamplingConfig with_top{.temperature = 0, .top_logprobs = 2};
  with_top.logprobs = false;
  absl::StatusOr<Sampler> s = Sampler::Create(with_top);
  ASSERT_THAT(s, IsOk());
  absl::StatusOr<SampledToken> t = s->Sample(kLogits);
  ASSERT_THAT(t, IsOk());
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  EXPECT_NEAR(t->logprob, 2.0 - std::log(z), 1e-5) << "top_logprobs forces the log-probabilities";
  EXPECT_EQ(t->top.size(), 2u);
}

// A draw without log-probabilities skips only their normaliser: the same seed draws the same
// tokens with and without them, at temperatures below and above 1 and with a nucleus cut.
TEST(SamplerTest, DrawsWithoutLogprobsMatchDrawsWithThem) {
  std::mt19937_64 rng(23);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (SamplingConfig config : {SamplingConfig{.temperature = 0.7f, .seed = 4},
                                SamplingConfig{.temperature = 1.6f, .seed = 5},
                                SamplingConfig{.temperature = 0.9f, .top_p = 0.8f, .seed = 6}}) {
    SamplingConfig lean = config;
    lean.logprobs = false;
    absl::StatusOr<Sampler> with = Sampler::Create(config), without = Sampler::Create(lean);
    ASSERT_THAT(with, IsOk());
    ASSERT_THAT(without, IsOk());
    for (int row = 0; row < 50; ++row) {
      std::vector<float> logits(300);
      for (float& l : logits) l = normal(rng);
      absl::StatusOr<SampledToken> a = with->Sample(logits), b = without->Sample(logits);
      ASSERT_THAT(a, IsOk());
      ASSERT_THAT(b, IsOk());
      EXPECT_EQ(a->id, b->id) << "temperature " << config.temperature << " row " << row;
      EXPECT_LT(a->logprob, 0.0f);
      EXPECT_EQ(b->logprob, 0.0f);
    }
  }
}

// The reported log-probabilities are the model's distribution at temperature 1 whatever the
// request's temperature, top-k and top-p (SampledToken's contract): the same for greedy, a
// low and a high temperature and a truncated draw, and the alternatives ordered by logit even
// where a low temperature underflows the sampling weights to 0.
TEST(SamplerTest, LogprobsAreTheTemperatureOneDistributionWhateverTheSamplingSettings) {
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  for (SamplingConfig config : {SamplingConfig{.temperature = 0}, SamplingConfig{.temperature = 0.01f},
                                SamplingConfig{.temperature = 3.0f}, SamplingConfig{.temperature = 0.7f, .top_k = 2},
                                SamplingConfig{.temperature = 1.3f, .top_p = 0.5f}}) {
    config.top_logprobs = 5;
    config.seed = 7;
    absl::StatusOr<Sampler> s = Sampler::Create(config);
    ASSERT_THAT(s, IsOk());
    absl::StatusOr<SampledToken> t = s->Sample(kLogits);
    ASSERT_THAT(t, IsOk());
    EXPECT_NEAR(t->logprob, kLogits[t->id] - std::log(z), 1e-5) << "temperature " << config.temperature;
    const std::vector<int32_t> by_logit = {1, 4, 2, 0, 3};
    ASSERT_EQ(t->top.size(), 5u);
    double mass = 0;
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(t->top[i].first, by_logit[i]) << "temperature " << config.temperature << " rank " << i;
      EXPECT_NEAR(t->top[i].second, kLogits[by_logit[i]] - std::log(z), 1e-5);
      mass += std::exp(t->top[i].second);
    }
    EXPECT_NEAR(mass, 1.0, 1e-5) << "the whole vocabulary";
  }
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

// A flat-ish row of 1000 logits whose nucleus at top_p 0.5 spans hundreds of ids, past the
// sampler's first partial-selection step: every draw lies inside the nucleus the test computes
// by sorting the whole row, and draws reach deep into it.
// The first sorted prefix (SortPrefix's selection pass): the reported alternatives are the best
// ids of a full sort in its order, over rows of many exact ties, -0 beside +0 (equal: the lower id
// first) and non-finite logits (last, as -inf), for 1 to 20 alternatives.
TEST(SamplerTest, TopLogprobsAreTheFullSortsFirstIds) {
  std::mt19937_64 rng(23);
  std::uniform_int_distribution<int> small(-4, 4);
  for (int row = 0; row < 60; ++row) {
    std::vector<float> logits(row % 2 == 0 ? 50 : 3000);
    for (float& l : logits) l = 0.5f * static_cast<float>(small(rng));
    logits[static_cast<size_t>(row) % logits.size()] = -0.0f;
    logits[(static_cast<size_t>(row) * 7 + 3) % logits.size()] = NAN;
    logits[(static_cast<size_t>(row) * 11 + 5) % logits.size()] = -INFINITY;
    if (row % 4 == 1) std::fill(logits.begin(), logits.begin() + 40, NAN);  // more non-finite than finite near the front
    const auto key = [&](int32_t id) {
      const float l = logits[static_cast<size_t>(id)];
      return std::isfinite(l) ? static_cast<double>(l) : -std::numeric_limits<double>::infinity();
    };
    std::vector<int32_t> sorted(logits.size());
    std::iota(sorted.begin(), sorted.end(), 0);
    std::stable_sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) { return key(a) > key(b); });
    const int top = 1 + row % 20;
    absl::StatusOr<Sampler> s = Sampler::Create({.temperature = row % 3 == 0 ? 0.0f : 0.7f, .seed = 5, .top_logprobs = top});
    ASSERT_THAT(s, IsOk());
    absl::StatusOr<SampledToken> t = s->Sample(logits);
    ASSERT_THAT(t, IsOk());
    ASSERT_EQ(t->top.size(), static_cast<size_t>(top));
    for (int i = 0; i < top; ++i) EXPECT_EQ(t->top[static_cast<size_t>(i)].first, sorted[static_cast<size_t>(i)]) << "row " << row << " rank " << i;
    if (row % 3 == 0) EXPECT_EQ(t->id, sorted[0]) << "greedy takes the first of the sort";
  }
}

TEST(SamplerTest, NucleusBeyondTheFirstSelectionStepMatchesAFullSort) {
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.001f * static_cast<float>((i * 7919) % 1000);
  std::vector<int32_t> by_logit(logits.size());
  std::iota(by_logit.begin(), by_logit.end(), 0);
  std::sort(by_logit.begin(), by_logit.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  std::set<int32_t> nucleus;
  double mass = 0;
  for (int32_t id : by_logit) {
    nucleus.insert(id);
    mass += std::exp(static_cast<double>(logits[id])) / z;
    if (mass >= 0.5) break;
  }
  ASSERT_GT(nucleus.size(), 256u) << "the nucleus must outgrow two selection steps";
  absl::StatusOr<Sampler> s = Sampler::Create({.temperature = 1.0f, .top_p = 0.5f, .seed = 3});
  ASSERT_THAT(s, IsOk());
  std::set<int32_t> seen;
  for (int i = 0; i < 3000; ++i) {
    absl::StatusOr<SampledToken> t = s->Sample(logits);
    ASSERT_THAT(t, IsOk());
    ASSERT_TRUE(nucleus.count(t->id)) << "token " << t->id << " is outside the nucleus";
    seen.insert(t->id);
  }
  EXPECT_GT(seen.size(), nucleus.size() / 2) << "draws cover the nucleus, not just its head";
}

// Plain temperature sampling draws by the inverse CDF walked most likely first (sampler.cc: so a
// seed's token survives small changes of the logits). Replayed here with the same random stream
// over a fully sorted row, over a vocabulary wide enough that the walk outgrows the sampler's
// first sorted step whenever it draws an unlikely token.
TEST(SamplerTest, TemperatureDrawsWalkTheSortedDistribution) {
  std::vector<float> logits(600);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.01f * static_cast<float>((i * 389) % 600);
  std::vector<int32_t> sorted(logits.size());
  std::iota(sorted.begin(), sorted.end(), 0);
  std::sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<double> weights(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp(static_cast<double>(logits[i]) - max_logit);
    total += weights[i];
  }
  absl::StatusOr<Sampler> s = Sampler::Create({.temperature = 1.0f, .seed = 21});
  ASSERT_THAT(s, IsOk());
  std::mt19937_64 rng(21);
  int deep = 0;
  for (int draw = 0; draw < 500; ++draw) {
    std::uniform_real_distribution<double> uniform(0.0, total);
    const double u = uniform(rng);
    double acc = 0;
    size_t rank = 0;
    for (; rank + 1 < sorted.size(); ++rank) {
      acc += weights[sorted[rank]];
      if (u < acc) break;
    }
    deep += rank >= 64;
    absl::StatusOr<SampledToken> t = s->Sample(logits);
    ASSERT_THAT(t, IsOk());
    ASSERT_EQ(t->id, sorted[rank]) << "draw " << draw;
  }
  EXPECT_GT(deep, 100) << "draws past the first sorted step";
}

// The draw a backend samples with (Sampler::DeviceDraw -> kernels::SampleRowHost, the reference
// the CUDA kernel equals bit for bit) picks what Sample picks from the same seed: greedy, plain
// temperature, top-k and top-p, over rows of 129280 ids like DeepSeek-V3's vocabulary, with ties
// and non-finite logits. The weights differ (integers of 2^-40 against doubles), so a draw within
// about 1e-6 of a boundary could differ; none of these 600 does.
TEST(SamplerTest, TheBackendsDrawPicksWhatSamplePicks) {
  std::mt19937_64 rng(77);
  std::normal_distribution<float> normal(0.0f, 2.5f);
  std::vector<std::vector<float>> rows(6, std::vector<float>(129280));
  for (size_t r = 0; r < rows.size(); ++r) {
    for (float& l : rows[r]) l = normal(rng);
    if (r % 2 == 1) {
      for (float& l : rows[r]) l = std::round(l * 2) / 2;  // many exact ties
    }
    rows[r][17] = -std::numeric_limits<float>::infinity();
    rows[r][99] = std::numeric_limits<float>::quiet_NaN();
  }
  const std::vector<SamplingConfig> configs = {
      {.temperature = 0, .logprobs = false},
      {.temperature = 1.0f, .seed = 5, .logprobs = false},
      {.temperature = 0.6f, .top_p = 0.95f, .seed = 6, .logprobs = false},
      {.temperature = 1.3f, .top_k = 50, .seed = 7, .logprobs = false},
      {.temperature = 0.8f, .top_p = 0.3f, .top_k = 1000, .seed = 8, .logprobs = false},
  };
  for (const SamplingConfig& config : configs) {
    for (bool keyed : {false, true}) {
      SamplingConfig c = config;
      c.position_keyed_draws = keyed;
      absl::StatusOr<Sampler> host = Sampler::Create(c);
      absl::StatusOr<Sampler> backend = Sampler::Create(c);
      ASSERT_THAT(host, IsOk());
      ASSERT_THAT(backend, IsOk());
      for (int step = 0; step < 60; ++step) {
        const std::vector<float>& row = rows[static_cast<size_t>(step) % rows.size()];
        absl::StatusOr<SampledToken> want = host->Sample(row);
        ASSERT_THAT(want, IsOk());
        const std::optional<kernels::SampleParams> draw = backend->DeviceDraw();
        ASSERT_TRUE(draw.has_value());
        const int32_t id = kernels::SampleRowHost(row, *draw);
        ASSERT_EQ(id, want->id) << "temperature " << c.temperature << " top_p " << c.top_p << " top_k " << c.top_k
                                << " keyed " << keyed << " step " << step;
        EXPECT_EQ(backend->CommitSampled(id).id, id);
      }
    }
  }
}

// A verification's rows on the backend (Sampler::DeviceDraws: each row the draw of its own
// position) pick what Sample picks token after token, and Verify of a deterministic draft (no
// draft distribution) at a temperature is that same pick, accepted exactly when it is the draft.
// DeviceDraws commits nothing, so it can be asked again after a rejection.
TEST(SamplerTest, VerificationRowsDrawWhatSamplePicksAtTheirPositions) {
  std::mt19937_64 rng(91);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<std::vector<float>> rows(4, std::vector<float>(5000));
  for (std::vector<float>& row : rows) {
    for (float& l : row) l = normal(rng);
  }
  for (const SamplingConfig& config : std::vector<SamplingConfig>{
           {.temperature = 0.8f, .top_p = 0.95f, .seed = 21, .logprobs = false},
           {.temperature = 1.2f, .top_k = 40, .seed = 22, .logprobs = false},
           {.temperature = 0, .logprobs = false}}) {
    SamplingConfig c = config;
    c.position_keyed_draws = true;
    absl::StatusOr<Sampler> plain = Sampler::Create(c);
    absl::StatusOr<Sampler> backend = Sampler::Create(c);
    absl::StatusOr<Sampler> verifier = Sampler::Create(c);
    ASSERT_THAT(plain, IsOk());
    ASSERT_THAT(backend, IsOk());
    ASSERT_THAT(verifier, IsOk());
    for (int round = 0; round < 3; ++round) {
      const std::optional<std::vector<kernels::SampleParams>> draws = backend->DeviceDraws(rows.size());
      ASSERT_TRUE(draws.has_value());
      ASSERT_EQ(draws->size(), rows.size());
      EXPECT_EQ(backend->DeviceDraws(rows.size())->front().u01, draws->front().u01) << "DeviceDraws committed";
      for (size_t k = 0; k < rows.size(); ++k) {
        absl::StatusOr<SampledToken> want = plain->Sample(rows[k]);
        ASSERT_THAT(want, IsOk());
        EXPECT_EQ(kernels::SampleRowHost(rows[k], (*draws)[k]), want->id)
            << "temperature " << c.temperature << " round " << round << " row " << k;
        // Every other row drafts the pick itself, the rest another token.
        const int32_t draft = k % 2 == 0 ? want->id : (want->id + 1) % static_cast<int32_t>(rows[k].size());
        absl::StatusOr<Sampler::Verdict> verdict = verifier->Verify(rows[k], draft, {});
        ASSERT_THAT(verdict, IsOk());
        EXPECT_EQ(verdict->token.id, want->id) << "row " << k;
        EXPECT_EQ(verdict->accepted, draft == want->id) << "row " << k;
        backend->CommitSampled(want->id);
      }
    }
  }
  // More than one row needs draws keyed by position; and what DeviceDraw refuses, DeviceDraws does.
  absl::StatusOr<Sampler> unkeyed = Sampler::Create({.temperature = 0.7f, .logprobs = false});
  ASSERT_THAT(unkeyed, IsOk());
  EXPECT_FALSE(unkeyed->DeviceDraws(2).has_value());
  EXPECT_TRUE(unkeyed->DeviceDraws(1).has_value());
  absl::StatusOr<Sampler> logprobs = Sampler::Create({.temperature = 0.7f, .position_keyed_draws = true});
  ASSERT_THAT(logprobs, IsOk());
  EXPECT_FALSE(logprobs->DrawsOnDevice());
  EXPECT_FALSE(logprobs->DeviceDraws(3).has_value());
}

// A request with logit_bias and penalties draws on the backend through DeviceDrawAdjusted: the
// row plus its delta, drawn by the backend's reference, picks what Sample picks (which adds the
// same delta on the host), greedy and seeded, token after token as the penalties grow.
TEST(SamplerTest, AnAdjustedDrawOnTheBackendPicksWhatSamplePicks) {
  std::mt19937_64 rng(78);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<std::vector<float>> rows(4, std::vector<float>(5000));
  for (auto& row : rows) {
    for (float& l : row) l = normal(rng);
  }
  const std::vector<std::pair<int32_t, float>> bias = {{7, 3.5f}, {4999, -100.0f}, {12, 1.25f}, {7, 0.5f}};
  const std::vector<SamplingConfig> configs = {
      {.temperature = 0, .logprobs = false, .frequency_penalty = 1.5f, .logit_bias = bias},
      {.temperature = 0, .logprobs = false, .presence_penalty = 2.0f},
      {.temperature = 0.9f, .seed = 4, .logprobs = false, .presence_penalty = 0.7f, .frequency_penalty = 0.4f,
       .logit_bias = bias},
      {.temperature = 1.1f, .top_p = 0.9f, .top_k = 200, .seed = 5, .logprobs = false, .frequency_penalty = -0.5f},
  };
  for (const SamplingConfig& c : configs) {
    absl::StatusOr<Sampler> host = Sampler::Create(c);
    absl::StatusOr<Sampler> backend = Sampler::Create(c);
    ASSERT_THAT(host, IsOk());
    ASSERT_THAT(backend, IsOk());
    EXPECT_FALSE(backend->DrawsOnDevice()) << "the plain device draw has no logit delta";
    std::vector<float> delta;
    for (int step = 0; step < 40; ++step) {
      const std::vector<float>& row = rows[static_cast<size_t>(step) % rows.size()];
      absl::StatusOr<SampledToken> want = host->Sample(row);
      ASSERT_THAT(want, IsOk());
      ASSERT_TRUE(backend->DrawsOnDeviceAdjusted(row.size()));
      const std::optional<kernels::SampleParams> draw = backend->DeviceDrawAdjusted(row.size(), delta);
      ASSERT_TRUE(draw.has_value());
      std::vector<float> adjusted = row;
      if (!delta.empty()) {
        ASSERT_EQ(delta.size(), row.size());
        for (size_t i = 0; i < row.size(); ++i) adjusted[i] += delta[i];
      }
      const int32_t id = kernels::SampleRowHost(adjusted, *draw);
      ASSERT_EQ(id, want->id) << "temperature " << c.temperature << " step " << step;
      backend->CommitSampled(id);
    }
  }
}

// The delta row holds exactly the request's adjustments: the biases of one id summed, each
// sampled id charged frequency x count + presence, zeros elsewhere; none before anything applies.
TEST(SamplerTest, TheLogitDeltaIsTheBiasLessThePenalties) {
  absl::StatusOr<Sampler> s = Sampler::Create({.temperature = 0,
                                               .logprobs = false,
                                               .presence_penalty = 0.5f,
                                               .frequency_penalty = 0.25f,
                                               .logit_bias = {{3, 2.0f}, {3, 1.0f}, {8, -4.0f}}});
  ASSERT_THAT(s, IsOk());
  std::vector<float> delta = {9.0f};
  ASSERT_TRUE(s->DeviceDrawAdjusted(10, delta).has_value());
  std::vector<float> want(10, 0.0f);
  want[3] = 3.0f;
  want[8] = -4.0f;
  EXPECT_EQ(delta, want);
  s->CommitSampled(5);
  s->CommitSampled(5);
  s->CommitSampled(3);
  ASSERT_TRUE(s->DeviceDrawAdjusted(10, delta).has_value());
  want[5] = -(0.25f * 2 + 0.5f);
  want[3] = 3.0f - (0.25f * 1 + 0.5f);
  EXPECT_EQ(delta, want);

  // Penalties alone adjust nothing until a token is sampled: no delta row to send.
  absl::StatusOr<Sampler> fresh = Sampler::Create({.temperature = 0, .logprobs = false, .presence_penalty = 1.0f});
  ASSERT_THAT(fresh, IsOk());
  EXPECT_FALSE(fresh->AdjustsLogits());
  ASSERT_TRUE(fresh->DeviceDrawAdjusted(10, delta).has_value());
  EXPECT_TRUE(delta.empty());
}

// What the adjusted device draw cannot take stays on the host, and draws nothing there: a
// request that reports log-probabilities, or a logit_bias id outside the row.
TEST(SamplerTest, AdjustedDrawsRefuseLogprobsAndBiasesOutsideTheRow) {
  absl::StatusOr<Sampler> logprobs = Sampler::Create({.temperature = 1.0f, .logit_bias = {{1, 1.0f}}});
  ASSERT_THAT(logprobs, IsOk());
  std::vector<float> delta;
  EXPECT_FALSE(logprobs->DrawsOnDeviceAdjusted(10));
  EXPECT_FALSE(logprobs->DeviceDrawAdjusted(10, delta).has_value());
  absl::StatusOr<Sampler> outside = Sampler::Create({.temperature = 0, .logprobs = false, .logit_bias = {{10, 1.0f}}});
  ASSERT_THAT(outside, IsOk());
  EXPECT_FALSE(outside->DeviceDrawAdjusted(10, delta).has_value());
  EXPECT_TRUE(outside->DeviceDrawAdjusted(11, delta).has_value());
}

TEST(SamplerTest, RequestsTheBackendCannotSampleStayOnTheHost) {
  for (const SamplingConfig& c : std::vector<SamplingConfig>{
           {.temperature = 0},  // log-probabilities reported by default
           {.temperature = 1.0f, .top_logprobs = 2, .logprobs = false},
           {.temperature = 1.0f, .logprobs = false, .presence_penalty = 0.5f},
           {.temperature = 1.0f, .logprobs = false, .frequency_penalty = -0.5f},
           {.temperature = 0, .logprobs = false, .logit_bias = {{3, 1.0f}}},
       }) {
    absl::StatusOr<Sampler> s = Sampler::Create(c);
    ASSERT_THAT(s, IsOk());
    EXPECT_FALSE(s->DeviceDraw().has_value());
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

// Greedy picks from kLogits under a penalty config, `steps` times in one sequence.
std::vector<int32_t> GreedyRun(SamplingConfig config, int steps) {
  config.temperature = 0;
  absl::StatusOr<Sampler> s = Sampler::Create(config);
  EXPECT_THAT(s, IsOk());
  std::vector<int32_t> ids;
  for (int i = 0; s.ok() && i < steps; ++i) {
    absl::StatusOr<SampledToken> t = s->Sample(kLogits);
    EXPECT_THAT(t, IsOk());
    if (t.ok()) ids.push_back(t->id);
  }
  return ids;
}

TEST(SamplerTest, LogitBiasIsAddedToTheRawLogits) {
  // -100 bans the argmax (id 1, logit 2.0): the next best (id 4, 1.5) wins.
  EXPECT_EQ(GreedyRun({.logit_bias = {{1, -100.0f}}}, 1), std::vector<int32_t>{4});
  // +100 forces the least likely token, and its reported logprob is that of the biased row.
  absl::StatusOr<Sampler> s = Sampler::Create({.temperature = 0, .logit_bias = {{3, 100.0f}}});
  ASSERT_THAT(s, IsOk());
  absl::StatusOr<SampledToken> t = s->Sample(kLogits);
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(t->id, 3);
  double z = std::exp(-1.0 + 100.0);
  for (size_t i = 0; i < kLogits.size(); ++i) z += i == 3 ? 0 : std::exp(kLogits[i]);
  EXPECT_NEAR(t->logprob, 99.0 - std::log(z), 1e-5);
  // A small bias only shifts: 1.0 + 0.6 beats 1.5 but not 2.0.
  EXPECT_EQ(GreedyRun({.logit_bias = {{2, 0.6f}, {4, -0.1f}}}, 1), std::vector<int32_t>{1});
  EXPECT_EQ(GreedyRun({.logit_bias = {{2, 0.6f}, {1, -0.5f}}}, 1), std::vector<int32_t>{2});
}

// logits 0.0 2.0 1.0 -1.0 1.5 (ids 0..4). OpenAI: logit[j] -= count[j] * frequency +
// (count[j] > 0) * presence, counting only the tokens this sequence sampled.
TEST(SamplerTest, FrequencyPenaltyGrowsWithEachOccurrence) {
  // id 1: 2.0, 1.4, 0.8 after 0, 1, 2 picks; id 4: 1.5, 0.9; id 2 stays 1.0.
  EXPECT_EQ(GreedyRun({.frequency_penalty = 0.6f}, 4), (std::vector<int32_t>{1, 4, 1, 2}));
  // A negative penalty rewards repetition.
  EXPECT_EQ(GreedyRun({.frequency_penalty = -1.0f}, 3), (std::vector<int32_t>{1, 1, 1}));
}

TEST(SamplerTest, PresencePenaltyIsChargedOncePerToken) {
  // id 1 drops to 1.4 once and stays there, above id 2 (1.0) and the penalised id 4 (0.9).
  EXPECT_EQ(GreedyRun({.presence_penalty = 0.6f}, 4), (std::vector<int32_t>{1, 4, 1, 1}));
  EXPECT_EQ(GreedyRun({}, 3), (std::vector<int32_t>{1, 1, 1}));
}

TEST(SamplerTest, RejectsBadPenaltiesAndBiases) {
  EXPECT_THAT(Sampler::Create({.presence_penalty = 2.5f}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("presence_penalty 2.5 must be in [-2, 2]")));
  EXPECT_THAT(Sampler::Create({.frequency_penalty = NAN}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("frequency_penalty")));
  EXPECT_THAT(Sampler::Create({.logit_bias = {{-1, 0.0f}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit_bias token id -1")));
  EXPECT_THAT(Sampler::Create({.logit_bias = {{0, 101.0f}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[-100, 100]")));
  absl::StatusOr<Sampler> s = Sampler::Create({.logit_bias = {{5, 1.0f}}});
  ASSERT_THAT(s, IsOk());
  EXPECT_THAT(s->Sample(kLogits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id 5 is outside the vocabulary of 5")));
}

}  // namespace
}  // namespace nq::worker
