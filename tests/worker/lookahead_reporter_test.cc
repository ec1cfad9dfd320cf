// LookaheadReporter (services/worker/lookahead_reporter.h): the worker's gate-lookahead hints and
// its count of hinted loads that landed in time, driven as the model drives it during a forward
// (predictions after each layer, the real routing after the forward). `warm_` plays the slot
// table: the test changes it between calls as a load landing mid-forward would.
#include "services/worker/lookahead_reporter.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

namespace nq::worker {
namespace {

model::MoeRouting Routing(std::vector<int32_t> experts, int tokens = 1) {
  model::MoeRouting r;
  r.num_tokens = tokens;
  r.top_k = static_cast<int>(experts.size()) / tokens;
  r.experts = std::move(experts);
  r.weights.assign(r.experts.size(), 0.25f);
  return r;
}

class LookaheadReporterTest : public ::testing::Test {
 protected:
  LookaheadReporter Make(int depth, int max_rows, bool accept = true) {
    return LookaheadReporter(
        depth, max_rows, [this](int64_t layer, int32_t expert) { return warm_.count({layer, expert}) != 0; },
        [this, accept](nq::v1::LookaheadHint hint) {
          if (!accept) return false;
          sent_.push_back(std::move(hint));
          return true;
        },
        registry_);
  }
  std::set<std::pair<int64_t, int32_t>> warm_;
  std::vector<nq::v1::LookaheadHint> sent_;
  metrics::Registry registry_;
};

TEST_F(LookaheadReporterTest, EachPredictionOfADecodeForwardBecomesAHintAtOnce) {
  LookaheadReporter reporter = Make(/*depth=*/1, /*max_rows=*/1);
  reporter.BeginForward(/*sequence_id=*/4, /*token=*/17);
  reporter.OnPredicted(2, Routing({5, 6}));
  ASSERT_EQ(sent_.size(), 1u);  // before the forward goes on
  EXPECT_EQ(sent_[0].sequence_id(), 4u);
  EXPECT_EQ(sent_[0].token(), 17u);
  EXPECT_EQ(sent_[0].layer(), 2u);
  EXPECT_EQ(sent_[0].source_layer(), 1u);
  EXPECT_EQ(std::vector<uint32_t>(sent_[0].experts().begin(), sent_[0].experts().end()),
            (std::vector<uint32_t>{5, 6}));
  EXPECT_EQ(sent_[0].weights_size(), 2);
  reporter.OnPredicted(3, Routing({1, 2}));
  EXPECT_EQ(sent_.size(), 2u);
  EXPECT_EQ(reporter.stats().hints_sent, 2u);
}

TEST_F(LookaheadReporterTest, PrefillForwardsSendNothing) {
  LookaheadReporter reporter = Make(1, /*max_rows=*/2);
  reporter.BeginForward(1, 0);
  reporter.OnPredicted(2, Routing({5, 6, 7, 8, 1, 2}, /*tokens=*/3));  // a 3-token prefill chunk
  EXPECT_TRUE(sent_.empty());
  // An MTP verification (1 + 1 draft) names every row's experts once, first row first.
  reporter.OnPredicted(3, Routing({5, 6, 6, 7}, /*tokens=*/2));
  ASSERT_EQ(sent_.size(), 1u);
  EXPECT_EQ(std::vector<uint32_t>(sent_[0].experts().begin(), sent_[0].experts().end()),
            (std::vector<uint32_t>{5, 6, 7}));
}

TEST_F(LookaheadReporterTest, ADroppedHintIsCountedAndDecodeGoesOn) {
  LookaheadReporter reporter = Make(1, 1, /*accept=*/false);
  reporter.BeginForward(1, 0);
  reporter.OnPredicted(2, Routing({5, 6}));
  reporter.OnPredicted(3, Routing({1, 2}));
  EXPECT_EQ(reporter.stats().hints_dropped, 2u);
  EXPECT_EQ(reporter.stats().hints_sent, 0u);
}

TEST_F(LookaheadReporterTest, CountsLandedMissedAndUnroutedAsOfWhenTheTargetLayerRan) {
  LookaheadReporter reporter = Make(1, 1);
  warm_.insert({2, 9});  // already at 4 bits when hinted: not a hinted load
  reporter.BeginForward(1, 0);
  reporter.OnPredicted(2, Routing({5, 6, 9}));  // after layer 1
  warm_.insert({2, 5});                         // 5's load lands before layer 2 runs
  reporter.OnPredicted(3, Routing({7}));        // after layer 2: 5 was in time, 6 was not
  warm_.insert({2, 6});                         // too late for this token
  reporter.OnRouting(1, Routing({0}));
  reporter.OnRouting(2, Routing({5, 6, 9}));
  reporter.OnRouting(3, Routing({8}));  // 7 was a wrong prediction
  reporter.EndForward();
  EXPECT_EQ(reporter.stats().landed, 1u);
  EXPECT_EQ(reporter.stats().missed, 1u);
  EXPECT_EQ(reporter.stats().unrouted, 1u);
  const std::string text = registry_.Serialize();
  EXPECT_NE(text.find("nq_worker_lookahead_experts_total{outcome=\"landed\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("nq_worker_lookahead_experts_total{outcome=\"missed\"} 1"), std::string::npos) << text;
}

TEST_F(LookaheadReporterTest, ALayerNoPredictionFollowsIsJudgedWhenItRan) {
  LookaheadReporter reporter = Make(1, 1);
  reporter.BeginForward(1, 0);
  reporter.OnPredicted(4, Routing({4, 5}));  // after layer 3; no prediction follows layer 4
  warm_.insert({4, 4});                      // landed before layer 4 ran
  reporter.LayerRan(4);
  warm_.insert({4, 5});  // landed after layer 4 ran: too late, though the table shows it now
  reporter.OnRouting(4, Routing({4, 5}));
  EXPECT_EQ(reporter.stats().landed, 1u);
  EXPECT_EQ(reporter.stats().missed, 1u);
}

}  // namespace
}  // namespace nq::worker
