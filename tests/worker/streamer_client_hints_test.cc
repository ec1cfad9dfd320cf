// The worker's StreamerClient sending gate-lookahead hints (issue #21) over real gRPC to a fake
// nq.v1.Streamer: a streamer that predates hints (RegisterWorkerResponse.accepts_lookahead_hints
// unset) never receives one and its session keeps working; one that takes them receives them as
// queued; and a streamer that stops reading never blocks the caller (the decode loop): hints past
// StreamerClient::kMaxQueuedHints are dropped and counted.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.grpc.pb.h"
#include "services/common/grpc_server.h"
#include "services/common/metrics/registry.h"
#include "services/common/slot_geometry.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/slot_table.h"
#include "services/worker/streamer_client.h"
#include "tests/common/wait_until.h"

namespace nq::worker {
namespace {

using ::nq::testing::WaitUntil;

// Registers anyone; its sessions record every message after the hello. `accepts` is what it
// answers in RegisterWorkerResponse.accepts_lookahead_hints (false: as a streamer before hints).
class FakeStreamer final : public nq::v1::Streamer::Service {
 public:
  explicit FakeStreamer(bool accepts) : accepts_(accepts) {}

  grpc::Status RegisterWorker(grpc::ServerContext*, const nq::v1::RegisterWorkerRequest*,
                              nq::v1::RegisterWorkerResponse* response) override {
    response->set_worker_id("w0");
    response->set_streamer_instance_id("fake");
    response->set_report_interval_tokens(16);
    if (accepts_) response->set_accepts_lookahead_hints(true);
    return grpc::Status::OK;
  }
  grpc::Status Session(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream) override {
    nq::v1::WorkerMessage message;
    if (!stream->Read(&message)) return grpc::Status::OK;  // the hello
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return reading_; };
      mu_.Await(absl::Condition(&ready));
    }
    while (stream->Read(&message)) {
      absl::MutexLock lock(&mu_);
      received_.push_back(message);
    }
    return grpc::Status::OK;
  }
  // Stops (false) or resumes (true) reading the sessions' messages.
  void SetReading(bool reading) {
    absl::MutexLock lock(&mu_);
    reading_ = reading;
  }
  std::vector<nq::v1::WorkerMessage> received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }

 private:
  const bool accepts_;
  absl::Mutex mu_;
  bool reading_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<nq::v1::WorkerMessage> received_ ABSL_GUARDED_BY(mu_);
};

nq::v1::LookaheadHint Hint(uint64_t token, int experts) {
  nq::v1::LookaheadHint hint;
  hint.set_sequence_id(1);
  hint.set_token(token);
  hint.set_layer(1);
  for (int e = 0; e < experts; ++e) hint.add_experts(static_cast<uint32_t>(e));
  return hint;
}

double Counter(const std::string& sample) {
  const std::string text = metrics::Registry::Default().Serialize();
  const size_t at = text.find("\n" + sample + " ");
  return at == std::string::npos ? 0 : std::stod(text.substr(at + sample.size() + 2));
}

class StreamerClientHintsTest : public ::testing::Test {
 protected:
  void Start(bool accepts) {
    fake_ = std::make_unique<FakeStreamer>(accepts);
    absl::StatusOr<std::unique_ptr<GrpcServer>> server =
        GrpcServer::Start(GrpcServerOptions{.host = "127.0.0.1", .port = 0, .services = {fake_.get()}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    table_ = std::make_unique<SlotTable>(SlotGeometry::Packed({1}, 4, 4096, 8, 1));
    runtime_ = std::make_unique<SlotRuntime>(table_.get(), std::span<const std::byte>(), nullptr);
    StreamerClientOptions options;
    options.address = server_->address();
    client_ = std::make_unique<StreamerClient>(std::move(options), runtime_.get(), nullptr);
    client_->Start();
    ASSERT_TRUE(WaitUntil([&] { return client_->connected(); }));
  }
  void TearDown() override {
    if (fake_) fake_->SetReading(true);
    if (client_) client_->Stop();
    if (server_) server_->Drain(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  size_t Received(nq::v1::WorkerMessage::MessageCase kind) {
    size_t n = 0;
    for (const nq::v1::WorkerMessage& m : fake_->received()) n += m.message_case() == kind ? 1 : 0;
    return n;
  }

  std::unique_ptr<FakeStreamer> fake_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<SlotTable> table_;
  std::unique_ptr<SlotRuntime> runtime_;
  std::unique_ptr<StreamerClient> client_;
};

TEST_F(StreamerClientHintsTest, AStreamerThatPredatesHintsNeverReceivesOneAndItsSessionWorks) {
  Start(/*accepts=*/false);
  const double dropped = Counter("nq_worker_lookahead_hints_total{result=\"dropped\"}");
  EXPECT_FALSE(client_->accepts_lookahead_hints());
  EXPECT_FALSE(client_->EnqueueLookaheadHint(Hint(0, 4)));
  EXPECT_EQ(Counter("nq_worker_lookahead_hints_total{result=\"dropped\"}"), dropped + 1);
  nq::v1::RoutingReport report;
  report.set_sequence_id(1);
  client_->EnqueueRoutingReport(report);
  ASSERT_TRUE(WaitUntil([&] { return Received(nq::v1::WorkerMessage::kRouting) == 1; }));
  EXPECT_EQ(Received(nq::v1::WorkerMessage::kLookahead), 0u);
  EXPECT_EQ(fake_->received().size(), 1u);  // nothing it could not parse either
  EXPECT_TRUE(client_->connected());
}

TEST_F(StreamerClientHintsTest, AStreamerThatTakesHintsReceivesThemInOrder) {
  Start(/*accepts=*/true);
  EXPECT_TRUE(client_->accepts_lookahead_hints());
  for (uint64_t token = 0; token < 3; ++token) EXPECT_TRUE(client_->EnqueueLookaheadHint(Hint(token, 4)));
  ASSERT_TRUE(WaitUntil([&] { return Received(nq::v1::WorkerMessage::kLookahead) == 3; }));
  const std::vector<nq::v1::WorkerMessage> received = fake_->received();
  for (uint64_t token = 0; token < 3; ++token) {
    EXPECT_EQ(received[token].lookahead().token(), token);
    EXPECT_EQ(received[token].lookahead().experts_size(), 4);
  }
}

TEST_F(StreamerClientHintsTest, AStreamerThatStopsReadingNeverBlocksTheCallerAndDropsAreCounted) {
  Start(/*accepts=*/true);
  fake_->SetReading(false);
  const double sent = Counter("nq_worker_lookahead_hints_total{result=\"sent\"}");
  const double dropped = Counter("nq_worker_lookahead_hints_total{result=\"dropped\"}");
  // Far more than gRPC's flow-control window holds (each hint about 600 bytes): the writer blocks
  // on the stream, the queue fills, and the oldest waiting hints go.
  constexpr int kHints = 20000;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kHints; ++i) client_->EnqueueLookaheadHint(Hint(static_cast<uint64_t>(i), 256));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The caller's cost is queueing alone (about microseconds a hint), not waiting on the streamer.
  EXPECT_LT(seconds, 5.0);
  const double dropped_now = Counter("nq_worker_lookahead_hints_total{result=\"dropped\"}") - dropped;
  EXPECT_GT(dropped_now, 0);
  // Every hint is sent, dropped or still queued (at most the cap, plus the one the writer holds).
  const double sent_now = Counter("nq_worker_lookahead_hints_total{result=\"sent\"}") - sent;
  EXPECT_GE(sent_now + dropped_now, kHints - static_cast<double>(StreamerClient::kMaxQueuedHints) - 1);
  EXPECT_LE(sent_now + dropped_now, kHints);
  // Reading again, the session goes on: the queued hints arrive, the newest last.
  fake_->SetReading(true);
  ASSERT_TRUE(WaitUntil([&] {
    const std::vector<nq::v1::WorkerMessage> received = fake_->received();
    return !received.empty() && received.back().lookahead().token() == kHints - 1;
  }));
}

}  // namespace
}  // namespace nq::worker
