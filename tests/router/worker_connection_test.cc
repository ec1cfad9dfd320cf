// WorkerConnection's readiness against an in-process worker whose health answers the test
// scripts: SERVING (and GetInfo) is ready; NOT_SERVING is not ready at once; one poll left
// unanswered (a health check slower than the poll deadline, as on a loaded host) keeps a ready
// worker ready; a worker that stops answering is not ready after
// kUnansweredPollsBeforeNotReady polls.
#include "services/router/worker_connection.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "nq/v1/worker.grpc.pb.h"

namespace nq::router {
namespace {

using std::chrono::milliseconds;

class ScriptedHealth final : public grpc::health::v1::Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* response) override {
    const int delay = delay_ms.load();
    if (delay > 0) {
      delayed_checks.fetch_add(1);
      std::this_thread::sleep_for(milliseconds(delay));
    }
    response->set_status(serving.load() ? grpc::health::v1::HealthCheckResponse::SERVING
                                        : grpc::health::v1::HealthCheckResponse::NOT_SERVING);
    return grpc::Status::OK;
  }
  std::atomic<bool> serving{true};
  std::atomic<int> delay_ms{0};
  std::atomic<int> delayed_checks{0};
};

class InfoOnlyWorker final : public nq::v1::Worker::Service {
 public:
  grpc::Status GetInfo(grpc::ServerContext*, const nq::v1::GetInfoRequest*, nq::v1::WorkerInfo*) override {
    return grpc::Status::OK;
  }
};

// Readiness flips the connection reported, in order.
class Flips {
 public:
  void Add(bool ready) {
    absl::MutexLock lock(&mu_);
    flips_.push_back(ready);
  }
  std::vector<bool> Get() const {
    absl::MutexLock lock(&mu_);
    return flips_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<bool> flips_;
};

// The connection sets ready() before it calls back, so a test that saw ready() change waits for
// the callback too before it reads the flips.
std::vector<bool> WaitForFlips(const Flips& flips, size_t count, milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (flips.Get().size() < count && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  return flips.Get();
}

bool WaitFor(const WorkerConnection& connection, bool ready, milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (connection.ready() == ready) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return connection.ready() == ready;
}

class WorkerConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&health_);
    builder.RegisterService(&worker_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    connection_ = std::make_unique<WorkerConnection>("127.0.0.1:" + std::to_string(port_), milliseconds(50),
                                                     [this](bool ready) { flips_.Add(ready); });
    connection_->Start();
  }
  void TearDown() override {
    if (connection_ != nullptr) connection_->Stop();
    if (server_ != nullptr) server_->Shutdown();
  }

  ScriptedHealth health_;
  InfoOnlyWorker worker_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  Flips flips_;
  std::unique_ptr<WorkerConnection> connection_;
};

TEST_F(WorkerConnectionTest, NotServingIsNotReadyAtOnceAndServingIsReadyAgain) {
  ASSERT_TRUE(WaitFor(*connection_, true, milliseconds(5000)));
  health_.serving = false;
  EXPECT_TRUE(WaitFor(*connection_, false, milliseconds(1000)));
  health_.serving = true;
  EXPECT_TRUE(WaitFor(*connection_, true, milliseconds(1000)));
  EXPECT_EQ(WaitForFlips(flips_, 3, milliseconds(1000)), (std::vector<bool>{true, false, true}));
}

TEST_F(WorkerConnectionTest, OneUnansweredPollKeepsAReadyWorkerReady) {
  ASSERT_TRUE(WaitFor(*connection_, true, milliseconds(5000)));
  // One health check outlasts the router's 1 s poll deadline; the next ones answer at once.
  health_.delay_ms = 1500;
  const auto end = std::chrono::steady_clock::now() + milliseconds(3000);
  while (health_.delayed_checks.load() == 0 && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_EQ(health_.delayed_checks.load(), 1);
  health_.delay_ms = 0;
  std::this_thread::sleep_for(milliseconds(1500));  // the slow poll timed out, later ones answered
  EXPECT_TRUE(connection_->ready());
  EXPECT_EQ(flips_.Get(), (std::vector<bool>{true}));
}

TEST_F(WorkerConnectionTest, AWorkerThatStopsAnsweringIsNotReady) {
  ASSERT_TRUE(WaitFor(*connection_, true, milliseconds(5000)));
  server_->Shutdown();
  server_.reset();
  EXPECT_TRUE(WaitFor(*connection_, false, milliseconds(5000)));
  EXPECT_EQ(WaitForFlips(flips_, 2, milliseconds(1000)), (std::vector<bool>{true, false}));
}

}  // namespace
}  // namespace nq::router
