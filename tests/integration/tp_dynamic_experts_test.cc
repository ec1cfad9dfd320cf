// Dynamic experts under tensor parallelism across real nq-worker processes (issue #18): one
// streamer decides for the group, loads each rank's own records into that rank's arena, and sends
// the group's updates to rank 0, which relays each in the step command of the step at which every
// rank applies it. Every rank logs each applied update with its step and the table's digest
// (SlotRuntime); the tests compare those lines across ranks, and every rank checks each slot
// announced READY against its own record (--verify_slots).
//
// The release is glm5_nano encoded for two ranks (no calibration: identity Hessians), made once
// per model directory under a lock, beside the embedded model's own release.
#include <regex>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

struct AppliedUpdate {
  uint64_t generation = 0;
  uint64_t step = 0;
  uint64_t ready = 0;
  std::string digest;
  bool operator==(const AppliedUpdate&) const = default;
};

std::ostream& operator<<(std::ostream& os, const AppliedUpdate& u) {
  return os << "{gen " << u.generation << " step " << u.step << " ready " << u.ready << " digest " << u.digest << "}";
}

// Every "slot table generation G applied before step S: N READY slots, digest D" line of a log.
std::vector<AppliedUpdate> AppliedUpdates(const std::string& log) {
  static const std::regex line(
      R"(slot table generation (\d+) applied before step (\d+): (\d+) READY slots, digest ([0-9a-f]+))");
  std::vector<AppliedUpdate> out;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    out.push_back(AppliedUpdate{.generation = std::stoull((*it)[1]),
                                .step = std::stoull((*it)[2]),
                                .ready = std::stoull((*it)[3]),
                                .digest = (*it)[4]});
  }
  return out;
}

class TpDynamicExpertsTest : public ServingTest {
 protected:
  static void SetUpTestSuite() {
    ServingTest::SetUpTestSuite();
    const std::string release = *model_dir_ + "/release_tp2";
    const std::string command = absl::StrCat(
        "set -e; exec 9>", *model_dir_, "/.lock_tp2; flock 9; if [ ! -f ", release, "/COMPLETE ]; then rm -rf ",
        release, "; ", NQ_TOOL_BIN, " encode --model ", *model_dir_, " --out ", release,
        " --tp 2 --fixed-per-layer 4 > /dev/null; fi");
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }

  std::vector<std::string> RankFlags(int rank) {
    return {"--model=" + *model_dir_,
            "--served_model_name=embedded",
            "--max_model_len=512",
            "--release=" + *model_dir_ + "/release_tp2",
            "--verify_slots",
            absl::StrCat("--rank=", rank),
            "--world_size=2",
            absl::StrCat("--leader_address=127.0.0.1:", worker_ports_.grpc)};
  }

  // Streamer, both ranks and the router; waits until the router serves.
  void StartGroup(std::vector<std::string> streamer_extra = {}) {
    for (int attempt = 1;; ++attempt) {
      streamer_ports_ = NewPorts();
      worker_ports_ = NewPorts();
      router_ports_ = NewPorts();
      follower_ports_ = NewPorts();
      std::vector<std::string> streamer_flags = {"--records_dir=" + *model_dir_ + "/release_tp2", "--read_budget=8"};
      streamer_flags.insert(streamer_flags.end(), streamer_extra.begin(), streamer_extra.end());
      streamer_.emplace(StartStreamer(streamer_ports_, streamer_flags));
      worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc, RankFlags(0)));
      follower_.emplace(StartWorker(follower_ports_, streamer_ports_.grpc, RankFlags(1)));
      router_.emplace(StartRouter(router_ports_, worker_ports_.grpc, {"--tokenizer=" + *model_dir_ + "/tokenizer.json"}));
      if (WaitServing(router_ports_.grpc, std::chrono::seconds(90))) return;
      const std::string logs = streamer_->Log() + worker_->Log() + follower_->Log() + router_->Log();
      if (attempt == 3 || logs.find("the address is in use") == std::string::npos) {
        FAIL() << "the group did not serve:\n" << logs;
      }
      for (std::optional<ChildProcess>* child : {&router_, &follower_, &worker_, &streamer_}) {
        (*child)->Signal(SIGKILL);
        (void)(*child)->WaitForExit(std::chrono::seconds(10));
        child->reset();
      }
    }
  }

  void TearDown() override {
    if (follower_.has_value()) {
      follower_->Signal(SIGTERM);
      absl::StatusOr<int> code = follower_->WaitForExit(std::chrono::seconds(20));
      EXPECT_TRUE(code.ok() && *code == 0) << follower_->Log();
      follower_.reset();
    }
    ServingTest::TearDown();
  }

  // Greedy completions of a few prompts; each must answer in full.
  void Serve(int rounds) {
    const char* prompts[] = {"def parse(", "class Node:\n    def __init__(self", "import os\nfor root, dirs",
                             "    return sorted("};
    for (int round = 0; round < rounds; ++round) {
      for (const char* prompt : prompts) {
        absl::StatusOr<std::pair<int, Json>> reply = PostJson(
            "/v1/completions", {{"model", "embedded"}, {"prompt", prompt}, {"max_tokens", 32}, {"temperature", 0}});
        ASSERT_TRUE(reply.ok()) << reply.status();
        ASSERT_EQ(reply->first, 200) << reply->second.dump() << worker_->Log();
        EXPECT_EQ(reply->second["usage"]["completion_tokens"], 32) << reply->second.dump();
      }
    }
  }

  // Both ranks applied the same updates, in the same order, before the same steps, and their
  // tables came out the same (the digests). Returns rank 0's list.
  std::vector<AppliedUpdate> ExpectSameTablesOnBothRanks() {
    const std::vector<AppliedUpdate> leader = AppliedUpdates(worker_->Log());
    const std::vector<AppliedUpdate> follower = AppliedUpdates(follower_->Log());
    EXPECT_THAT(leader, Not(IsEmpty())) << worker_->Log();
    EXPECT_EQ(follower, leader) << "rank 1 applied other tables, or at other steps, than rank 0";
    return leader;
  }

  ServicePorts follower_ports_;
  std::optional<ChildProcess> follower_;
};

TEST_F(TpDynamicExpertsTest, BothRanksSwitchExpertsAtTheSameStepsWithTheirOwnRecords) {
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  ASSERT_NO_FATAL_FAILURE(Serve(2));
  const int s = streamer_ports_.http;
  const std::vector<AppliedUpdate> applied = ExpectSameTablesOnBothRanks();
  // The predictor placed floating experts beyond the fixed sets (4 per MoE layer), and later
  // tables differ from earlier ones: experts really switched during decoding.
  uint64_t most_ready = 0;
  for (const AppliedUpdate& u : applied) most_ready = std::max(most_ready, u.ready);
  const double fixed_loads = Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}");
  EXPECT_GT(fixed_loads, 0) << HttpGet(s, "/metrics").body;
  EXPECT_GT(Metric(s, "nq_streamer_expert_calls_total{bits=\"4\"}"), 0);
  EXPECT_GT(most_ready, 0u);
  bool applied_mid_request = false;
  for (const AppliedUpdate& u : applied) applied_mid_request |= u.step > 0;
  EXPECT_TRUE(applied_mid_request) << "no update was applied during decoding";
  // Rank 1 relays nothing to the streamer: its routing is rank 0's.
  EXPECT_EQ(Metric(s, "nq_streamer_sessions_active"), 2);
  // Each rank's READY slots hold that rank's own record (checked against its release).
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(follower_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(follower_ports_.http, "nq_worker_slot_updates_rejected_total"), 0);
  EXPECT_GT(Metric(follower_ports_.http, "nq_expert_calls_total{bits=\"4\"}"), 0);
  EXPECT_THAT(streamer_->Log(), HasSubstr("all 2 ranks have sessions; one loader decides for them"));
}

// Every read of rank 1's records fails half the time (rank 0's never): a load whose rank-1 read
// failed must reach no rank, so the tables stay equal and rank 1 never maps a slot without its
// bytes (its --verify_slots would count it).
TEST_F(TpDynamicExpertsTest, OneRanksFailedReadsAreAppliedByNoRank) {
  ASSERT_NO_FATAL_FAILURE(StartGroup({"--inject_read_faults=eio=0.5,rank=1,seed=11"}));
  ASSERT_NO_FATAL_FAILURE(Serve(1));
  const int s = streamer_ports_.http;
  EXPECT_GT(Metric(s, "nq_streamer_read_errors_total{reason=\"io_error\"}"), 0) << HttpGet(s, "/metrics").body;
  EXPECT_GT(Metric(s, "nq_streamer_slot_loads_total{result=\"failed\"}"), 0);
  EXPECT_GT(Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}"), 0) << "no load landed on both ranks";
  ExpectSameTablesOnBothRanks();
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(follower_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
}

}  // namespace
}  // namespace nq::testing
