// Gate lookahead within a token (issue #21) through the real binaries on glm5_nano: the worker
// (--lookahead_layers=1) reports layer L+1's predicted experts as soon as layer L ran, the
// streamer loads those not resident, and with a slot mailbox (applied before every MoE layer
// while lookahead is on) a load may serve the very token that asked for it.
//
// What is asserted without depending on timing: hints flow and are all well formed, the streamer
// turns some into loads that become READY, and no slot is ever seen changing while mapped
// (--verify_slots). Whether a given load lands before its layer runs is a race with the forward;
// over enough tokens some do, so the test sends requests until one has (bounded). Tokens with
// lookahead on and off are compared where the precision of every call is the same by
// construction: a static precision (--expert_bits=fixed), where the hints load nothing and the
// observer's extra host routing must leave every token as it was. With streamed experts the
// hints change which experts run at 4 bits, so the tokens may rightly differ.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

const std::vector<std::string> kPrompts = {
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
};

class LookaheadServingTest : public ServingTest {
 protected:
  // The greedy completion of `prompt`.
  std::string Complete(const std::string& prompt, int max_tokens) {
    const Json request = {{"model", "embedded"}, {"prompt", prompt}, {"max_tokens", max_tokens},
                          {"temperature", 0},    {"ignore_eos", true}};
    absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/completions", request);
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (!reply.ok()) return "";
    EXPECT_EQ(reply->first, 200) << reply->second.dump();
    return reply->second["choices"][0]["text"].get<std::string>();
  }
  std::vector<std::string> CompleteAll(int max_tokens) {
    std::vector<std::string> texts;
    for (const std::string& prompt : kPrompts) texts.push_back(Complete(prompt, max_tokens));
    return texts;
  }
  void StopCluster() {
    for (std::optional<ChildProcess>* child : {&router_, &worker_, &streamer_}) {
      if (!child->has_value()) continue;
      (*child)->Signal(SIGTERM);
      absl::StatusOr<int> code = (*child)->WaitForExit(std::chrono::seconds(20));
      EXPECT_TRUE(code.ok() && *code == 0) << (*child)->Log();
      child->reset();
    }
  }
  double Worker(const std::string& name) { return Metric(worker_ports_.http, name); }
  double Streamer(const std::string& name) { return Metric(streamer_ports_.http, name); }
};

TEST_F(LookaheadServingTest, HintedLoadsBecomeReadyAndSomeLandBeforeTheirLayerRuns) {
  StartCluster({}, /*streamed=*/true, {"--lookahead_layers=1", "--slot_mailbox=on"});
  // Each request is 4 MoE layers x 48 tokens of hints; landing is a race with the forward, so
  // keep sending (bounded) until one hinted expert was at 4 bits when its layer ran.
  constexpr int kMaxRounds = 10;
  for (int round = 0; round < kMaxRounds && Worker("nq_worker_lookahead_experts_total{outcome=\"landed\"}") <= 0;
       ++round) {
    Complete(kPrompts[static_cast<size_t>(round) % kPrompts.size()], 48);
  }
  EXPECT_GT(Worker("nq_worker_lookahead_hints_total{result=\"sent\"}"), 0) << worker_->Log();
  EXPECT_GT(Streamer("nq_streamer_lookahead_hints_total{result=\"accepted\"}"), 0) << streamer_->Log();
  // The worker sends only well-formed hints of its current sequence.
  EXPECT_EQ(Streamer("nq_streamer_lookahead_hints_total{result=\"refused\"}"), 0) << streamer_->Log();
  EXPECT_GT(Streamer("nq_streamer_lookahead_loads_total{stage=\"queued\"}"), 0);
  EXPECT_GT(Streamer("nq_streamer_lookahead_loads_total{stage=\"ready\"}"), 0);
  EXPECT_GT(Worker("nq_worker_lookahead_experts_total{outcome=\"landed\"}"), 0)
      << "missed: " << Worker("nq_worker_lookahead_experts_total{outcome=\"missed\"}");
  // Loads landing mid-token never changed a slot the worker had mapped.
  EXPECT_EQ(Worker("nq_worker_slot_integrity_failures_total"), 0);
}

TEST_F(LookaheadServingTest, AtAStaticPrecisionLookaheadLeavesEveryTokenAsItWas) {
  StartCluster({}, /*streamed=*/true, {"--expert_bits=fixed"});
  const std::vector<std::string> off = CompleteAll(24);
  StopCluster();
  StartCluster({}, /*streamed=*/true, {"--expert_bits=fixed", "--lookahead_layers=1"});
  const std::vector<std::string> on = CompleteAll(24);
  // The observer ran: the worker predicted and tried to report every decode token's layers.
  EXPECT_GT(Worker("nq_worker_lookahead_hints_total{result=\"sent\"}") +
                Worker("nq_worker_lookahead_hints_total{result=\"dropped\"}"),
            0);
  ASSERT_EQ(on.size(), off.size());
  for (size_t i = 0; i < on.size(); ++i) {
    EXPECT_FALSE(off[i].empty());
    EXPECT_EQ(on[i], off[i]) << "prompt " << i;
  }
}

}  // namespace
}  // namespace nq::testing
