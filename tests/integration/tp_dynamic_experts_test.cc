// Dynamic experts under tensor parallelism across real nq-worker processes (issue #18): one
// streamer decides for the group, loads each rank's own records into that rank's arena, and sends
// the group's updates to rank 0, which relays each in the step command of the step at which every
// rank applies it. Every rank logs each applied update with its step and the table's digest
// (SlotRuntime); the tests compare those lines across ranks, and every rank checks each slot
// announced READY against its own record (--verify_slots).
//
// The releases are glm5_nano encoded for two and for four ranks (no calibration: identity
// Hessians), made once per model directory under a lock, beside the embedded model's own release.
#include <signal.h>

#include <unistd.h>

#include <optional>
#include <thread>
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
    for (int world : {2, 4}) {
      const std::string release = absl::StrCat(*model_dir_, "/release_tp", world);
      const std::string command = absl::StrCat(
          "set -e; exec 9>", *model_dir_, "/.lock_tp; flock 9; if [ ! -f ", release, "/COMPLETE ]; then rm -rf ",
          release, "; ", NQ_TOOL_BIN, " encode --model ", *model_dir_, " --out ", release, " --tp ", world,
          " --fixed-per-layer 4 > /dev/null; fi");
      ASSERT_EQ(std::system(command.c_str()), 0) << command;
    }
  }

  std::string Release() const { return absl::StrCat(*model_dir_, "/release_tp", world_); }

  std::vector<std::string> RankFlags(int rank) {
    return {"--model=" + *model_dir_,
            "--served_model_name=embedded",
            "--max_model_len=512",
            "--release=" + Release(),
            "--verify_slots",
            absl::StrCat("--rank=", rank),
            absl::StrCat("--world_size=", world_),
            absl::StrCat("--leader_address=127.0.0.1:", worker_ports_.grpc)};
  }

  // A second node's streamer (docs/tp_streamers.md): it applies the decisions of streamer_ from
  // its own copy of the release, for the ranks that register with it.
  ChildProcess StartApplier() {
    return StartStreamer(applier_ports_, {"--records_dir=" + applier_records_, "--read_budget=8",
                                          absl::StrCat("--decider_address=127.0.0.1:", streamer_ports_.grpc)});
  }

  // Streamer, ranks 0..world-1 and the router; waits until the router serves. With
  // `applier_records` set, ranks world/2.. register with a second streamer (StartApplier) reading
  // that copy of the release, as the ranks of a second node would.
  void StartGroup(int world, std::vector<std::string> streamer_extra = {}, std::string applier_records = "") {
    applier_records_ = std::move(applier_records);
    world_ = world;
    for (int attempt = 1;; ++attempt) {
      streamer_ports_ = NewPorts();
      worker_ports_ = NewPorts();
      router_ports_ = NewPorts();
      std::vector<std::string> streamer_flags = {"--records_dir=" + Release(), "--read_budget=8"};
      streamer_flags.insert(streamer_flags.end(), streamer_extra.begin(), streamer_extra.end());
      streamer_.emplace(StartStreamer(streamer_ports_, streamer_flags));
      if (!applier_records_.empty()) {
        applier_ports_ = NewPorts();
        applier_.emplace(StartApplier());
      }
      worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc, RankFlags(0)));
      followers_.clear();
      follower_ports_.clear();
      for (int r = 1; r < world; ++r) {
        follower_ports_.push_back(NewPorts());
        const bool second_node = !applier_records_.empty() && r >= world / 2;
        followers_.push_back(
            StartWorker(follower_ports_.back(), second_node ? applier_ports_.grpc : streamer_ports_.grpc, RankFlags(r)));
      }
      router_.emplace(StartRouter(router_ports_, worker_ports_.grpc, {"--tokenizer=" + *model_dir_ + "/tokenizer.json"}));
      if (WaitServing(router_ports_.grpc, std::chrono::seconds(90))) return;
      std::string logs = streamer_->Log() + worker_->Log() + router_->Log();
      if (applier_) logs += applier_->Log();
      for (ChildProcess& f : followers_) logs += f.Log();
      if (attempt == 3 || logs.find("the address is in use") == std::string::npos) {
        FAIL() << "the group did not serve:\n" << logs;
      }
      for (ChildProcess& f : followers_) {
        f.Signal(SIGKILL);
        (void)f.WaitForExit(std::chrono::seconds(10));
      }
      followers_.clear();
      for (std::optional<ChildProcess>* child : {&router_, &worker_, &applier_, &streamer_}) {
        if (!child->has_value()) continue;
        (*child)->Signal(SIGKILL);
        (void)(*child)->WaitForExit(std::chrono::seconds(10));
        child->reset();
      }
    }
  }

  void TearDown() override {
    for (ChildProcess& f : followers_) {
      f.Signal(SIGTERM);
      absl::StatusOr<int> code = f.WaitForExit(std::chrono::seconds(20));
      EXPECT_TRUE(code.ok() && *code == 0) << f.Log();
    }
    followers_.clear();
    if (applier_) {
      applier_->Signal(SIGTERM);
      absl::StatusOr<int> code = applier_->WaitForExit(std::chrono::seconds(20));
      EXPECT_TRUE(code.ok() && *code == 0) << applier_->Log();
      applier_.reset();
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

  // Every rank applied the same updates, in the same order, before the same steps, and their
  // tables came out the same (the digests); none counted a READY slot whose bytes are not its
  // own rank's record. Returns rank 0's list.
  std::vector<AppliedUpdate> ExpectSameTablesOnEveryRank() {
    const std::vector<AppliedUpdate> leader = AppliedUpdates(worker_->Log());
    EXPECT_THAT(leader, Not(IsEmpty())) << worker_->Log();
    EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
    for (size_t f = 0; f < followers_.size(); ++f) {
      EXPECT_EQ(AppliedUpdates(followers_[f].Log()), leader)
          << "rank " << f + 1 << " applied other tables, or at other steps, than rank 0";
      EXPECT_EQ(Metric(follower_ports_[f].http, "nq_worker_slot_integrity_failures_total"), 0) << "rank " << f + 1;
      EXPECT_EQ(Metric(follower_ports_[f].http, "nq_worker_slot_updates_rejected_total"), 0) << "rank " << f + 1;
    }
    return leader;
  }

  int world_ = 2;
  std::string applier_records_;
  ServicePorts applier_ports_;
  std::optional<ChildProcess> applier_;
  std::vector<ServicePorts> follower_ports_;
  std::vector<ChildProcess> followers_;
};

TEST_F(TpDynamicExpertsTest, BothRanksSwitchExpertsAtTheSameStepsWithTheirOwnRecords) {
  ASSERT_NO_FATAL_FAILURE(StartGroup(2));
  ASSERT_NO_FATAL_FAILURE(Serve(2));
  const int s = streamer_ports_.http;
  const std::vector<AppliedUpdate> applied = ExpectSameTablesOnEveryRank();
  EXPECT_GT(Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}"), 0) << HttpGet(s, "/metrics").body;
  EXPECT_GT(Metric(s, "nq_streamer_expert_calls_total{bits=\"4\"}"), 0);
  // The fixed sets (4 of each MoE layer's 32 experts) are not all there is: the table changed
  // during decoding, not only before a prompt.
  bool applied_mid_request = false;
  for (const AppliedUpdate& u : applied) applied_mid_request |= u.step > 0;
  EXPECT_TRUE(applied_mid_request) << "no update was applied during decoding";
  EXPECT_GT(applied.back().ready, 0u);
  // One session per rank, one loader for both.
  EXPECT_EQ(Metric(s, "nq_streamer_sessions_active"), 2);
  EXPECT_THAT(streamer_->Log(), HasSubstr("all 2 ranks have sessions; one loader decides for them"));
  // Both ranks ran the same expert calls at 4 bits: the same table at every step.
  EXPECT_GT(Metric(follower_ports_[0].http, "nq_expert_calls_total{bits=\"4\"}"), 0);
  EXPECT_EQ(Metric(follower_ports_[0].http, "nq_expert_calls_total{bits=\"4\"}"),
            Metric(worker_ports_.http, "nq_expert_calls_total{bits=\"4\"}"));
}

// Four ranks: every load waits for four records, every unmap for four acknowledgements.
TEST_F(TpDynamicExpertsTest, FourRanksSwitchExpertsAtTheSameSteps) {
  ASSERT_NO_FATAL_FAILURE(StartGroup(4));
  ASSERT_NO_FATAL_FAILURE(Serve(1));
  ExpectSameTablesOnEveryRank();
  EXPECT_EQ(Metric(streamer_ports_.http, "nq_streamer_sessions_active"), 4);
  EXPECT_GT(Metric(streamer_ports_.http, "nq_streamer_expert_calls_total{bits=\"4\"}"), 0);
}

// Four ranks over two nodes' streamers (docs/tp_streamers.md): ranks 0 and 1 register with the
// deciding streamer, ranks 2 and 3 with a second one that reads their records from its own copy
// of the release on the decider's orders. Every rank still switches at the same steps with its own
// records. The second streamer is killed during a request: the request completes, no rank maps a
// slot without its bytes, and once that streamer is back the group loads at 4 bits again.
TEST_F(TpDynamicExpertsTest, TwoNodesStreamersServeOneGroupAndItRecoversWhenTheApplyingOneDies) {
  const std::string copy = ::testing::TempDir() + "/nq_tp4_second_node_" + std::to_string(getpid());
  ASSERT_EQ(std::system(absl::StrCat("rm -rf ", copy, " && cp -a ", *model_dir_, "/release_tp4 ", copy).c_str()), 0);
  ASSERT_NO_FATAL_FAILURE(StartGroup(4, {}, copy));
  const int decider = streamer_ports_.http;
  ASSERT_TRUE(WaitFor([&] { return Metric(decider, "nq_streamer_peer_links_active") == 2; }, std::chrono::seconds(30)))
      << streamer_->Log() << applier_->Log();
  ASSERT_NO_FATAL_FAILURE(Serve(1));
  ExpectSameTablesOnEveryRank();
  EXPECT_THAT(streamer_->Log(), HasSubstr("all 4 ranks have sessions; one loader decides for them"));
  EXPECT_THAT(streamer_->Log(), HasSubstr("2 ranks served by other nodes' streamers"));
  EXPECT_EQ(Metric(decider, "nq_streamer_sessions_active"), 2);
  EXPECT_EQ(Metric(applier_ports_.http, "nq_streamer_sessions_active"), 2);
  // Rank 2's and 3's records were read by the second streamer, none failed.
  EXPECT_GT(Metric(applier_ports_.http, "nq_streamer_peer_orders_total{result=\"ok\"}"), 0) << applier_->Log();
  EXPECT_EQ(Metric(applier_ports_.http, "nq_streamer_peer_orders_total{result=\"failed\"}"), 0);
  EXPECT_EQ(Metric(decider, "nq_streamer_slot_loads_total{result=\"failed\"}"), 0);
  EXPECT_GT(Metric(follower_ports_[1].http, "nq_expert_calls_total{bits=\"4\"}"), 0);

  // The second node's streamer dies while a request runs.
  absl::StatusOr<std::pair<int, Json>> during;
  std::thread request([&] {
    during = PostJson("/v1/completions",
                      {{"model", "embedded"}, {"prompt", "def parse("}, {"max_tokens", 96}, {"temperature", 0}});
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  applier_->Signal(SIGKILL);
  ASSERT_TRUE(applier_->WaitForExit(std::chrono::seconds(10)).ok());
  request.join();
  ASSERT_TRUE(during.ok()) << during.status();
  ASSERT_EQ(during->first, 200) << during->second.dump();
  EXPECT_EQ(during->second["usage"]["completion_tokens"], 96);
  // The decider ended the group's loader: its link count drops.
  ASSERT_TRUE(WaitFor([&] { return Metric(decider, "nq_streamer_peer_links_active") == 0; }, std::chrono::seconds(20)));
  const double ready_before = Metric(decider, "nq_streamer_slot_loads_total{result=\"ready\"}");
  const double rank2_4bit_before = Metric(follower_ports_[1].http, "nq_expert_calls_total{bits=\"4\"}");
  ASSERT_NO_FATAL_FAILURE(Serve(1));  // at 2 bits for what is not loaded: the group still serves

  applier_.emplace(StartApplier());
  ASSERT_TRUE(WaitFor([&] { return Metric(decider, "nq_streamer_peer_links_active") == 2; }, std::chrono::seconds(60)))
      << streamer_->Log() << applier_->Log();
  ASSERT_NO_FATAL_FAILURE(Serve(2));
  EXPECT_GT(Metric(decider, "nq_streamer_slot_loads_total{result=\"ready\"}"), ready_before)
      << "nothing loaded once the second node's streamer was back";
  EXPECT_GT(Metric(applier_ports_.http, "nq_streamer_peer_orders_total{result=\"ok\"}"), 0) << applier_->Log();
  EXPECT_GT(Metric(follower_ports_[1].http, "nq_expert_calls_total{bits=\"4\"}"), rank2_4bit_before);
  // Every rank applied the same tables at the same steps throughout, and none mapped a slot
  // whose bytes were not its own rank's record.
  ExpectSameTablesOnEveryRank();
  std::system(absl::StrCat("rm -rf ", copy).c_str());
}

// Rank 0 must register with the streamer that decides: one that applies another's decisions
// refuses its session by name (the worker keeps serving at 2 bits and retries).
TEST_F(TpDynamicExpertsTest, RankZeroOnAnApplyingStreamerIsRefusedByName) {
  world_ = 2;
  streamer_ports_ = NewPorts();
  worker_ports_ = NewPorts();
  applier_records_ = Release();
  streamer_.emplace(StartStreamer(streamer_ports_, {"--records_dir=" + Release()}));
  applier_ports_ = NewPorts();
  applier_.emplace(StartApplier());
  worker_.emplace(StartWorker(worker_ports_, applier_ports_.grpc, RankFlags(0)));
  follower_ports_.push_back(NewPorts());
  followers_.push_back(StartWorker(follower_ports_.back(), applier_ports_.grpc, RankFlags(1)));
  EXPECT_TRUE(WaitFor([&] { return applier_->Log().find("rank 0 registers with the deciding streamer") != std::string::npos; },
                      std::chrono::seconds(60)))
      << applier_->Log();
  // Rank 1 may link (it belongs there), but without rank 0 no group forms.
  EXPECT_THAT(streamer_->Log(), Not(HasSubstr("one loader decides")));
}

// A streamer that itself applies another's decisions is no decider: the links the second node's
// streamer opens to it are refused by name, and that refusal shows on the second node.
TEST_F(TpDynamicExpertsTest, ALinkToAStreamerThatAppliesIsRefusedByName) {
  world_ = 2;
  streamer_ports_ = NewPorts();
  worker_ports_ = NewPorts();
  applier_records_ = Release();
  streamer_.emplace(StartStreamer(streamer_ports_, {"--records_dir=" + Release(), "--decider_address=127.0.0.1:1"}));
  applier_ports_ = NewPorts();
  applier_.emplace(StartApplier());
  worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc, RankFlags(0)));
  follower_ports_.push_back(NewPorts());
  followers_.push_back(StartWorker(follower_ports_.back(), applier_ports_.grpc, RankFlags(1)));
  EXPECT_TRUE(WaitFor([&] { return applier_->Log().find("this streamer applies the decisions of 127.0.0.1:1") !=
                                   std::string::npos; },
                      std::chrono::seconds(60)))
      << applier_->Log();
  EXPECT_EQ(Metric(streamer_ports_.http, "nq_streamer_peer_links_active"), 0);
}

// A rank killed and restarted: the group re-forms, every rank starts from an empty slot table
// (rank 0 clears its own and registers with the streamer again), and from then on the restarted
// rank applies what rank 0 applies.
TEST_F(TpDynamicExpertsTest, ARestartedRankStartsFromTheSameEmptyTableAsRankZero) {
  ASSERT_NO_FATAL_FAILURE(StartGroup(2));
  ASSERT_NO_FATAL_FAILURE(Serve(1));
  ASSERT_THAT(AppliedUpdates(worker_->Log()), Not(IsEmpty()));
  followers_[0].Signal(SIGKILL);
  ASSERT_TRUE(followers_[0].WaitForExit(std::chrono::seconds(10)).ok());
  ASSERT_TRUE(WaitFor([&] { return GrpcHealth(worker_ports_.grpc) != grpc::health::v1::HealthCheckResponse::SERVING; },
                      std::chrono::seconds(10)));
  // The router too must have seen the group broken (it polls the leader), or its SERVING below
  // could still be the answer from before the kill.
  ASSERT_TRUE(WaitFor([&] { return GrpcHealth(router_ports_.grpc) != grpc::health::v1::HealthCheckResponse::SERVING; },
                      std::chrono::seconds(10)));
  follower_ports_[0] = NewPorts();
  followers_[0] = StartWorker(follower_ports_[0], streamer_ports_.grpc, RankFlags(1));
  ASSERT_TRUE(WaitServing(router_ports_.grpc, std::chrono::seconds(60))) << worker_->Log() << followers_[0].Log();
  ASSERT_NO_FATAL_FAILURE(Serve(1));

  const std::string leader_log = worker_->Log();
  const size_t cleared = leader_log.find("slot table cleared for a newly formed tensor-parallel group");
  ASSERT_NE(cleared, std::string::npos) << leader_log;
  const std::vector<AppliedUpdate> since = AppliedUpdates(leader_log.substr(cleared));
  EXPECT_THAT(since, Not(IsEmpty()));
  EXPECT_EQ(since.front().generation, 1u) << "the streamer did not start over from rank 0's cleared table";
  EXPECT_EQ(AppliedUpdates(followers_[0].Log()), since);
  EXPECT_EQ(Metric(follower_ports_[0].http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
}

// Every read of rank 1's records fails half the time (rank 0's never): a load whose rank-1 read
// failed must reach no rank, so the tables stay equal and rank 1 never maps a slot without its
// bytes (its --verify_slots would count it).
TEST_F(TpDynamicExpertsTest, OneRanksFailedReadsAreAppliedByNoRank) {
  ASSERT_NO_FATAL_FAILURE(StartGroup(2, {"--inject_read_faults=eio=0.5,rank=1,seed=11"}));
  ASSERT_NO_FATAL_FAILURE(Serve(1));
  const int s = streamer_ports_.http;
  EXPECT_GT(Metric(s, "nq_streamer_read_errors_total{reason=\"io_error\"}"), 0) << HttpGet(s, "/metrics").body;
  EXPECT_GT(Metric(s, "nq_streamer_slot_loads_total{result=\"failed\"}"), 0);
  EXPECT_GT(Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}"), 0) << "no load landed on both ranks";
  ExpectSameTablesOnEveryRank();
}

}  // namespace
}  // namespace nq::testing
