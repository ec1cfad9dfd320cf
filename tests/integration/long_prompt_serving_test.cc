// Long prompts through the real binaries (issue #23): the worker states how many tokens fit;
// a long prompt prefills layer-major with its routed experts at 4 bits (counted in
// nq_worker_prefill_expert_calls_total), also with few slots of its own when it borrows the rest
// from the free KV cache; a client that goes away mid-prefill frees the worker long before the
// prefill would have ended, and the worker serves the next request.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "nq/v1/worker.grpc.pb.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

// `length` tokens of glm5_nano's held-out text from `offset`.
std::vector<uint32_t> HeldOut(size_t offset, size_t length) {
  std::ifstream in(std::string(NQ_SOURCE_DIR) + "/models/glm5_nano/eval/libs_code.tokens.json");
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<uint32_t> ids = nlohmann::json::parse(text.str()).get<std::vector<uint32_t>>();
  return std::vector<uint32_t>(ids.begin() + static_cast<std::ptrdiff_t>(offset),
                               ids.begin() + static_cast<std::ptrdiff_t>(offset + length));
}

class LongPromptServingTest : public ServingTest {
 protected:
  std::unique_ptr<nq::v1::Worker::Stub> Stub() {
    return nq::v1::Worker::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", worker_ports_.grpc), grpc::InsecureChannelCredentials()));
  }
  // A greedy request straight to the worker; `context` may be cancelled from another thread.
  static std::pair<grpc::Status, int> Generate(nq::v1::Worker::Stub& stub, grpc::ClientContext& context,
                                               const std::vector<uint32_t>& prompt, uint32_t max_tokens) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    nq::v1::WorkerGenerateRequest request;
    request.set_request_id(absl::StrCat("long-", prompt.size(), "-", prompt[0]));
    for (uint32_t id : prompt) request.add_prompt_token_ids(id);
    request.mutable_sampling()->set_temperature(0);
    request.mutable_sampling()->set_max_tokens(max_tokens);
    request.mutable_sampling()->set_ignore_eos(true);
    auto reader = stub.Generate(&context, request);
    nq::v1::WorkerGenerateResponse response;
    int tokens = 0;
    while (reader->Read(&response)) tokens += response.tokens_size();
    return {reader->Finish(), tokens};
  }
};

// --max_model_len=auto takes what the host's free memory holds, up to the model's limit: this
// machine has gigabytes free and glm5_nano's cache needs kilobytes a token, so the limit.
TEST_F(LongPromptServingTest, AutoContextTakesTheModelsLimitWhenMemoryAllows) {
  StartCluster({}, /*streamed=*/false, {"--max_model_len=auto"});
  EXPECT_THAT(worker_->Log(), HasSubstr("--max_model_len=auto: 4096 tokens"));
  EXPECT_THAT(worker_->Log(), HasSubstr("context: the KV cache holds 4096 tokens"));
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_context_tokens{kind=\"allocated\"}"), 4096);
}

TEST_F(LongPromptServingTest, ALongPromptPrefillsAt4BitsAndACancelMidPrefillFreesTheWorker) {
  StartCluster({}, /*streamed=*/true,
               {"--max_model_len=4096", "--prefill_chunk_tokens=128", "--layer_major_prefill_tokens=1024",
                "--prefill_full_span_tokens=1024"});
  EXPECT_THAT(worker_->Log(), HasSubstr("context: the KV cache holds 4096 tokens"));
  EXPECT_THAT(worker_->Log(), HasSubstr("the model's limit is 4096"));
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_context_tokens{kind=\"allocated\"}"), 4096);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_context_tokens{kind=\"model_limit\"}"), 4096);
  std::unique_ptr<nq::v1::Worker::Stub> stub = Stub();

  // 1500 new tokens: layer-major, every routed expert they use at 4 bits (glm5_nano: 4 MoE
  // layers of 32 experts, 4 per token).
  {
    grpc::ClientContext context;
    const auto [status, tokens] = Generate(*stub, context, HeldOut(0, 1500), 2);
    ASSERT_TRUE(status.ok()) << status.error_message() << worker_->Log();
    EXPECT_EQ(tokens, 2);
  }
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_prefill_expert_calls_total{bits=\"4\"}"), 1500.0 * 4 * 4);
  EXPECT_LE(Metric(worker_ports_.http, "nq_worker_prefill_expert_calls_total{bits=\"2\"}"), 0);

  // How long a 3000-token prefill takes here, then another one cut off a quarter of the way in.
  const auto full_start = Clock::now();
  {
    grpc::ClientContext context;
    const auto [status, tokens] = Generate(*stub, context, HeldOut(2000, 3000), 1);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  const auto full = Clock::now() - full_start;
  grpc::ClientContext cancelled_context;
  Clock::time_point cancelled_at;
  std::thread client_leaves([&] {
    std::this_thread::sleep_for(full / 4);
    cancelled_at = Clock::now();
    cancelled_context.TryCancel();
  });
  const auto [cancelled_status, cancelled_tokens] = Generate(*stub, cancelled_context, HeldOut(6000, 3000), 1);
  client_leaves.join();
  EXPECT_EQ(cancelled_status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(cancelled_tokens, 0);
  // The next request is served as soon as the worker stops, within a chunk of the cancel.
  grpc::ClientContext next_context;
  const auto [next_status, next_tokens] = Generate(*stub, next_context, HeldOut(9500, 20), 4);
  const auto freed_after = Clock::now() - cancelled_at;
  ASSERT_TRUE(next_status.ok()) << next_status.error_message();
  EXPECT_EQ(next_tokens, 4);
  // For bench/README.md: what this machine measured.
  std::printf("a 3000-token prefill took %.2f s; after a cancel %.2f s into another, the next request was served "
              "%.3f s after the cancel\n",
              std::chrono::duration<double>(full).count(), std::chrono::duration<double>(full / 4).count(),
              std::chrono::duration<double>(freed_after).count());
  EXPECT_LT(freed_after, full / 2) << "full prefill "
                                   << std::chrono::duration<double>(full).count() << " s, next request served "
                                   << std::chrono::duration<double>(freed_after).count() << " s after the cancel";
}

// Slot borrowing through the real binaries: 2 own slots, and the free KV cache past the prompt
// lends the other 30, so a long prompt still runs every routed expert call at 4 bits. The borrow
// is returned when the prefill ends; the next turn, whose KV rows grow into the rows the first
// turn lent, borrows again past its own span and is served.
TEST_F(LongPromptServingTest, TwoOwnSlotsAndBorrowedOnesRunALongConversationAt4Bits) {
  StartCluster({}, /*streamed=*/true,
               {"--max_model_len=4096", "--prefill_chunk_tokens=256", "--layer_major_prefill_tokens=1024",
                "--prefill_full_span_tokens=1024", "--prefill_expert_slots=2"});
  EXPECT_THAT(worker_->Log(), HasSubstr("slot borrowing from the free KV cache: up to 30 slots"));
  std::unique_ptr<nq::v1::Worker::Stub> stub = Stub();
  for (const size_t prompt : {1200, 2400}) {
    grpc::ClientContext context;
    const auto [status, tokens] = Generate(*stub, context, HeldOut(0, prompt), 2);
    ASSERT_TRUE(status.ok()) << status.error_message() << worker_->Log();
    EXPECT_EQ(tokens, 2);
  }
  // Both turns' new spans (1200 tokens each; the second reuses the first's prompt) at 4 bits:
  // glm5_nano's 4 MoE layers, 4 experts a token.
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_prefill_expert_calls_total{bits=\"4\"}"), 2400.0 * 4 * 4);
  EXPECT_LE(Metric(worker_ports_.http, "nq_worker_prefill_expert_calls_total{bits=\"2\"}"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_prefill_borrows_total"), 2);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_prefill_borrowed_slots"), 0) << "a borrow outlived its prefill";
}

TEST_F(LongPromptServingTest, WithoutBorrowingTwoOwnSlotsServeAFractionOfTheCalls) {
  StartCluster({}, /*streamed=*/true,
               {"--max_model_len=4096", "--prefill_chunk_tokens=256", "--layer_major_prefill_tokens=1024",
                "--prefill_full_span_tokens=1024", "--prefill_expert_slots=2", "--prefill_borrow_kv=false"});
  EXPECT_THAT(worker_->Log(), Not(HasSubstr("slot borrowing")));
  std::unique_ptr<nq::v1::Worker::Stub> stub = Stub();
  grpc::ClientContext context;
  const auto [status, tokens] = Generate(*stub, context, HeldOut(0, 1200), 2);
  ASSERT_TRUE(status.ok()) << status.error_message() << worker_->Log();
  const double four = Metric(worker_ports_.http, "nq_worker_prefill_expert_calls_total{bits=\"4\"}");
  EXPECT_GT(four, 0);
  EXPECT_LT(four, 1200.0 * 4 * 4 / 2) << "2 slots of 32 served half the calls or more";
  EXPECT_LE(Metric(worker_ports_.http, "nq_worker_prefill_borrows_total"), 0);
}

}  // namespace
}  // namespace nq::testing
