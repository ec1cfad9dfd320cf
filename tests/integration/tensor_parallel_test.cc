// Tensor parallelism across real nq-worker processes (issue #18) on the embedded model
// (models/glm5_nano): rank 0 serves the router, ranks 1..W-1 follow it over shared memory.
// W = 2 and W = 4 give W = 1's greedy tokens (and its log-probabilities within 1e-4); a rank
// killed mid-generation fails the request with the reason, the leader is NOT_SERVING until the
// rank restarts, and then serves the same tokens again; a rank started with another world
// size or another identity is refused by name.
#include <signal.h>

#include <atomic>
#include <cmath>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "nq/v1/inference.grpc.pb.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kGreedyTokens = 64;

struct Generated {
  grpc::Status status;
  std::vector<uint32_t> ids;
  std::vector<float> logprobs;
  // Per token: (id, logprob) of the top alternatives.
  std::vector<std::vector<std::pair<uint32_t, float>>> top;
};

class TpWorkerProcessesTest : public ServingTest {
 protected:
  // Streamer, rank 0 (world `world`), ranks 1..world-1 and the router; waits until the router
  // serves. Restarts on fresh ports when another process took one first (as StartCluster).
  void StartTpCluster(int world) {
    for (int attempt = 1;; ++attempt) {
      world_ = world;
      streamer_ports_ = NewPorts();
      worker_ports_ = NewPorts();
      router_ports_ = NewPorts();
      streamer_.emplace(StartStreamer(streamer_ports_));
      worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc, RankFlags(0, world)));
      followers_.clear();
      for (int r = 1; r < world; ++r) followers_.push_back(StartFollower(r, world));
      router_.emplace(StartRouter(router_ports_, worker_ports_.grpc,
                                  {"--tokenizer=" + *model_dir_ + "/tokenizer.json"}));
      if (WaitServing(router_ports_.grpc, std::chrono::seconds(90))) return;
      std::string logs = streamer_->Log() + worker_->Log() + router_->Log();
      for (ChildProcess& f : followers_) logs += f.Log();
      if (attempt == 3 || logs.find("the address is in use") == std::string::npos) {
        FAIL() << "the cluster did not serve:\n" << logs;
      }
      StopCluster(SIGKILL);
    }
  }

  std::vector<std::string> RankFlags(int rank, int world) {
    std::vector<std::string> flags = {"--model=" + *model_dir_, "--served_model_name=embedded", "--max_model_len=512",
                                      absl::StrCat("--rank=", rank), absl::StrCat("--world_size=", world),
                                      absl::StrCat("--leader_address=127.0.0.1:", worker_ports_.grpc)};
    flags.insert(flags.end(), rank_extra_.begin(), rank_extra_.end());
    return flags;
  }
  // Added to every rank's flags (set before StartTpCluster).
  std::vector<std::string> rank_extra_;

  ChildProcess StartFollower(int rank, int world, std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = RankFlags(rank, world);
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartWorker(NewPorts(), streamer_ports_.grpc, flags);
  }

  void StopCluster(int signal_number = SIGTERM) {
    std::vector<ChildProcess*> children;
    for (std::optional<ChildProcess>* child : {&router_, &worker_, &streamer_}) {
      if (child->has_value()) children.push_back(&**child);
    }
    for (ChildProcess& f : followers_) children.push_back(&f);
    for (ChildProcess* child : children) {
      child->Signal(signal_number);
      absl::StatusOr<int> code = child->WaitForExit(std::chrono::seconds(20));
      if (signal_number == SIGTERM) {
        EXPECT_TRUE(code.ok() && *code == 0) << child->Log();
      }
    }
    router_.reset();
    worker_.reset();
    streamer_.reset();
    followers_.clear();
  }

  void TearDown() override {
    for (ChildProcess& f : followers_) {
      f.Signal(SIGTERM);
      absl::StatusOr<int> code = f.WaitForExit(std::chrono::seconds(20));
      EXPECT_TRUE(code.ok() && *code == 0) << f.Log();
    }
    followers_.clear();
    ServingTest::TearDown();
  }

  // Greedy tokens with their top-5 log-probabilities; `progress` (if set) counts the tokens as
  // they stream in.
  Generated Generate(const std::string& prompt, int max_tokens, std::chrono::seconds deadline = std::chrono::seconds(120),
                     std::atomic<int>* progress = nullptr) {
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_ports_.grpc), grpc::InsecureChannelCredentials());
    auto stub = nq::v1::Inference::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    nq::v1::GenerateRequest request;
    request.set_prompt(prompt);
    request.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(max_tokens));
    request.mutable_sampling()->set_temperature(0);
    request.mutable_sampling()->set_top_logprobs(5);
    request.mutable_sampling()->set_ignore_eos(true);
    request.set_return_tokens(true);
    auto reader = stub->Generate(&context, request);
    nq::v1::GenerateResponse response;
    Generated out;
    while (reader->Read(&response)) {
      for (const nq::v1::TokenLogprob& token : response.tokens()) {
        out.ids.push_back(token.token_id());
        out.logprobs.push_back(token.logprob());
        auto& top = out.top.emplace_back();
        for (const nq::v1::TokenAlternative& alt : token.top()) top.emplace_back(alt.token_id(), alt.logprob());
        if (progress != nullptr) ++*progress;
      }
    }
    out.status = reader->Finish();
    return out;
  }

  // The W = 1 reference, then the same prompts through a W-rank group.
  void ExpectSameAsOneRank(const std::vector<Generated>& reference, int world) {
    StartTpCluster(world);
    for (size_t p = 0; p < prompts_.size(); ++p) {
      const auto start = std::chrono::steady_clock::now();
      const Generated got = Generate(prompts_[p], kGreedyTokens);
      RecordProperty(absl::StrCat("generate_ms_w", world, "_p", p),
                     static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::steady_clock::now() - start)
                                          .count()));
      ASSERT_TRUE(got.status.ok()) << got.status.error_message() << worker_->Log();
      EXPECT_EQ(got.ids, reference[p].ids) << "W=" << world << " prompt " << p;
      ASSERT_EQ(got.top.size(), reference[p].top.size());
      double worst = 0;
      for (size_t t = 0; t < got.top.size(); ++t) {
        worst = std::max(worst, std::abs(static_cast<double>(got.logprobs[t]) - reference[p].logprobs[t]));
        ASSERT_EQ(got.top[t].size(), reference[p].top[t].size());
        for (size_t k = 0; k < got.top[t].size(); ++k) {
          worst = std::max(worst, std::abs(static_cast<double>(got.top[t][k].second) - reference[p].top[t][k].second));
        }
      }
      // Log-probabilities are logits minus one shared log-sum-exp, so this bounds the logits'
      // difference too (bench: the threads' W = 2 and 4 differ from W = 1 by ~1e-6).
      EXPECT_LT(worst, 1e-4) << "W=" << world << " prompt " << p;
      RecordProperty(absl::StrCat("max_logprob_diff_w", world, "_p", p), absl::StrCat(worst));
    }
    StopCluster();
  }

  int world_ = 1;
  std::vector<ChildProcess> followers_;
  const std::vector<std::string> prompts_ = {"def fibonacci(n):", "import os\nclass Config:\n    def __init__(self"};
};

TEST_F(TpWorkerProcessesTest, TwoAndFourRankGroupsGiveTheGreedyTokensOfOneRank) {
  StartTpCluster(1);
  std::vector<Generated> reference;
  for (const std::string& prompt : prompts_) {
    const auto start = std::chrono::steady_clock::now();
    reference.push_back(Generate(prompt, kGreedyTokens));
    RecordProperty(absl::StrCat("generate_ms_w1_p", reference.size() - 1),
                   static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::steady_clock::now() - start)
                                        .count()));
    ASSERT_TRUE(reference.back().status.ok()) << reference.back().status.error_message();
    ASSERT_EQ(reference.back().ids.size(), static_cast<size_t>(kGreedyTokens));
  }
  StopCluster();
  ExpectSameAsOneRank(reference, 2);
  ExpectSameAsOneRank(reference, 4);
}

// The group's control channel over TCP (--tp_control=tcp), as ranks on other hosts need: the
// same greedy tokens as one rank, and a rank that dies fails the request and the group re-forms
// once it is back.
TEST_F(TpWorkerProcessesTest, RanksOverTcpGiveTheGreedyTokensOfOneRankAndReformAfterARankDies) {
  const int control_port = NewPorts().grpc;
  rank_extra_ = {"--tp_control=tcp", absl::StrCat("--tp_control_port=", control_port)};
  StartTpCluster(1);
  std::vector<Generated> reference;
  for (const std::string& prompt : prompts_) {
    reference.push_back(Generate(prompt, kGreedyTokens));
    ASSERT_TRUE(reference.back().status.ok()) << reference.back().status.error_message();
  }
  StopCluster();
  ExpectSameAsOneRank(reference, 4);

  StartTpCluster(2);
  EXPECT_THAT(worker_->Log(), HasSubstr(absl::StrCat("tcp 127.0.0.1:", control_port)));
  std::optional<Generated> failed;
  std::atomic<int> streamed{0};
  std::thread client([&] { failed = Generate(prompts_[1], 400, std::chrono::seconds(120), &streamed); });
  const bool decoding = WaitFor([&] { return streamed >= 5; }, std::chrono::seconds(60));
  followers_[0].Signal(SIGKILL);
  ASSERT_TRUE(followers_[0].WaitForExit(std::chrono::seconds(10)).ok());
  client.join();
  ASSERT_TRUE(decoding);
  ASSERT_TRUE(failed.has_value());
  EXPECT_FALSE(failed->status.ok());
  EXPECT_THAT(failed->status.error_message(), AllOf(HasSubstr("rank 1"), HasSubstr("left the group")));
  EXPECT_TRUE(WaitFor([&] { return GrpcHealth(worker_ports_.grpc) == grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      std::chrono::seconds(10)));
  // Back as the chart starts a second node's first rank: rank 0 of node 1, one rank a node.
  followers_[0] = StartFollower(1, 2, {"--node_rank=1", "--ranks_per_node=1", "--rank=0"});
  ASSERT_TRUE(WaitServing(worker_ports_.grpc, std::chrono::seconds(60))) << worker_->Log() << followers_[0].Log();
  ASSERT_TRUE(WaitServing(router_ports_.grpc, std::chrono::seconds(30)));
  EXPECT_THAT(followers_[0].Log(), HasSubstr("rank 1 of the group: rank 0 of node 1"));
  const Generated after = Generate(prompts_[0], kGreedyTokens);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << worker_->Log();
  EXPECT_EQ(after.ids, reference[0].ids);
  EXPECT_THAT(worker_->Log(), HasSubstr("generation 2) formed"));
  StopCluster();
}

// MTP speculative decoding under tensor parallelism: the MTP layer is sharded like the others,
// so rank 0 mirrors the drafter's forwards (step_command.h, kForwardMtpLast) and every rank runs
// them. Two ranks drafting give one rank's greedy tokens, and drafts are accepted.
TEST_F(TpWorkerProcessesTest, MtpDraftsOnTwoRanksGiveTheGreedyTokensOfOneRank) {
  rank_extra_ = {"--speculative_tokens=2"};
  StartTpCluster(1);
  std::vector<Generated> reference;
  for (const std::string& prompt : prompts_) {
    reference.push_back(Generate(prompt, kGreedyTokens));
    ASSERT_TRUE(reference.back().status.ok()) << reference.back().status.error_message() << worker_->Log();
    ASSERT_EQ(reference.back().ids.size(), static_cast<size_t>(kGreedyTokens));
  }
  EXPECT_GT(Metric(worker_ports_.http, "nq_spec_decode_num_accepted_tokens_total"), 0) << "one rank drafted nothing";
  StopCluster();
  StartTpCluster(2);
  for (size_t p = 0; p < prompts_.size(); ++p) {
    const Generated got = Generate(prompts_[p], kGreedyTokens);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message() << worker_->Log() << followers_[0].Log();
    EXPECT_EQ(got.ids, reference[p].ids) << "prompt " << p;
  }
  const double accepted = Metric(worker_ports_.http, "nq_spec_decode_num_accepted_tokens_total");
  EXPECT_GT(accepted, 0) << "two ranks drafted nothing";
  RecordProperty("mtp_accepted_tokens_w2", absl::StrCat(accepted));
  StopCluster();
}

TEST_F(TpWorkerProcessesTest, KilledRankFailsTheRequestAndTheGroupServesAgainOnceItRestarts) {
  StartTpCluster(2);
  const Generated before = Generate(prompts_[0], 16);
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();

  // A long request; rank 1 dies while it runs.
  std::optional<Generated> failed;
  std::atomic<int> streamed{0};
  std::thread client([&] { failed = Generate(prompts_[1], 400, std::chrono::seconds(120), &streamed); });
  const bool decoding = WaitFor([&] { return streamed >= 5; }, std::chrono::seconds(60));
  followers_[0].Signal(SIGKILL);
  ASSERT_TRUE(followers_[0].WaitForExit(std::chrono::seconds(10)).ok());
  client.join();
  ASSERT_TRUE(decoding);
  ASSERT_TRUE(failed.has_value());
  EXPECT_FALSE(failed->status.ok());
  EXPECT_LT(failed->ids.size(), 400u);
  EXPECT_THAT(failed->status.error_message(), AllOf(HasSubstr("rank 1"), HasSubstr("died")));

  // The leader stays up but does not serve without its group.
  EXPECT_TRUE(WaitFor([&] { return GrpcHealth(worker_ports_.grpc) == grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      std::chrono::seconds(10)));
  EXPECT_TRUE(worker_->Running());
  // ...and the router, which follows its leader's health, says so too.
  EXPECT_TRUE(WaitFor([&] { return GrpcHealth(router_ports_.grpc) == grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      std::chrono::seconds(10)));
  EXPECT_FALSE(Generate(prompts_[0], 4, std::chrono::seconds(10)).status.ok());

  // Rank 1 comes back: the group re-forms and serves the same greedy tokens as before.
  followers_[0] = StartFollower(1, 2);
  ASSERT_TRUE(WaitServing(worker_ports_.grpc, std::chrono::seconds(60))) << worker_->Log() << followers_[0].Log();
  ASSERT_TRUE(WaitServing(router_ports_.grpc, std::chrono::seconds(30)));
  const Generated after = Generate(prompts_[0], 16);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << worker_->Log();
  EXPECT_EQ(after.ids, before.ids);
  EXPECT_THAT(worker_->Log(), HasSubstr("generation 2) formed"));
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_tp_groups_formed_total"), 2);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_tp_group_ready"), 1);
}

TEST_F(TpWorkerProcessesTest, RanksOfAnotherWorldSizeOrIdentityAreRefusedByName) {
  streamer_ports_ = NewPorts();
  worker_ports_ = NewPorts();
  streamer_.emplace(StartStreamer(streamer_ports_));
  worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc, RankFlags(0, 2)));

  ChildProcess wrong_world = StartFollower(1, 4);
  absl::StatusOr<int> code = wrong_world.WaitForExit(std::chrono::seconds(60));
  ASSERT_TRUE(code.ok()) << wrong_world.Log();
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(wrong_world.Log(), AllOf(HasSubstr("world size mismatch"), HasSubstr("world size 2"),
                                       HasSubstr("started with world size 4")));

  ChildProcess wrong_context = StartFollower(1, 2, {"--max_model_len=256"});
  code = wrong_context.WaitForExit(std::chrono::seconds(60));
  ASSERT_TRUE(code.ok()) << wrong_context.Log();
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(wrong_context.Log(), HasSubstr("max_model_len mismatch: rank 0 serves '512', this rank '256'"));
  // Rank 0 names the refusals too, and is still waiting for its group.
  EXPECT_TRUE(WaitFor([&] { return worker_->Log().find("max_model_len mismatch") != std::string::npos; },
                      std::chrono::seconds(10)))
      << worker_->Log();
  EXPECT_NE(GrpcHealth(worker_ports_.grpc), grpc::health::v1::HealthCheckResponse::SERVING);

  // The right rank joins, and the leader serves.
  followers_.push_back(StartFollower(1, 2));
  EXPECT_TRUE(WaitServing(worker_ports_.grpc, std::chrono::seconds(60))) << worker_->Log();
}

TEST_F(TpWorkerProcessesTest, UnsupportedCombinationsAreRefusedAtStartByName) {
  const std::string tiny = "--model=" NQ_SOURCE_DIR "/tests/fixtures/models/glm5_tiny";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--world_size=2"}, "--world_size=2 needs --model"},
#if !defined(NQ_WORKER_HAS_NCCL)
      // Ranks on the GPU run their collectives over NCCL: a build without it refuses them at start
      // (a build with it forms the group; scripts/device/run_nccl_single_rank.sh runs it).
      {{"--world_size=2", tiny, "--backend=cuda"}, "this nq-worker was built without NCCL"},
#endif
      {{"--world_size=2", tiny, "--tp_timeout_s=0"}, "tp_timeout_s"},
      {{"--world_size=2", "--rank=1", tiny, "--leader_address=nohostport"}, "--leader_address=nohostport"},
  };
  for (const Case& c : cases) {
    ChildProcess child = StartWorker(NewPorts(), FreePort(), c.args);
    absl::StatusOr<int> code = child.WaitForExit(std::chrono::seconds(30));
    ASSERT_TRUE(code.ok()) << c.args.back() << ": still running\n" << child.Log();
    EXPECT_NE(*code, 0) << c.args.back();
    EXPECT_THAT(child.Log(), HasSubstr(c.message)) << c.args.back();
  }
}

}  // namespace
}  // namespace nq::testing
