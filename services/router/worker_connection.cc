#include "services/router/worker_connection.h"

#include <grpcpp/health_check_service_interface.h>

#include <spdlog/spdlog.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "services/common/logging.h"

namespace nq::router {
namespace {

// Each poll is a unary call with a deadline well under the poll interval, so a hung worker
// is noticed within one interval (DESIGN.md section 8: every internal RPC has a deadline).
constexpr std::chrono::milliseconds kPollDeadline{1000};

}  // namespace

WorkerConnection::WorkerConnection(std::string address, std::chrono::milliseconds poll_interval,
                                   std::function<void(bool)> on_ready_change,
                                   std::shared_ptr<const InternalTls> tls)
    : address_(std::move(address)),
      poll_interval_(poll_interval),
      on_ready_change_(std::move(on_ready_change)),
      channel_(InternalChannel(address_, tls.get())),
      stub_(nq::v1::Worker::NewStub(channel_)),
      ready_gauge_(metrics::Registry::Default()
                       .Gauge("nq_router_worker_ready",
                              "Whether the leader worker reports SERVING (1) or not (0)")
                       .Get()) {}

WorkerConnection::~WorkerConnection() { Stop(); }

void WorkerConnection::Start() { thread_ = std::thread([this] { Watch(); }); }

void WorkerConnection::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::optional<nq::v1::WorkerInfo> WorkerConnection::info() const {
  absl::MutexLock lock(&mu_);
  return info_;
}

WorkerConnection::PollResult WorkerConnection::Poll() {
  grpc::health::v1::HealthCheckRequest request;  // "" = the server as a whole
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext health_context;
  health_context.set_deadline(std::chrono::system_clock::now() + kPollDeadline);
  auto health = grpc::health::v1::Health::NewStub(channel_);
  const grpc::Status status = health->Check(&health_context, request, &response);
  if (!status.ok()) return PollResult::kUnanswered;
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) return PollResult::kNotServing;
  grpc::ClientContext info_context;
  info_context.set_deadline(std::chrono::system_clock::now() + kPollDeadline);
  nq::v1::WorkerInfo info;
  if (!stub_->GetInfo(&info_context, nq::v1::GetInfoRequest(), &info).ok()) return PollResult::kUnanswered;
  absl::MutexLock lock(&mu_);
  info_ = std::move(info);
  return PollResult::kServing;
}

void WorkerConnection::Watch() {
  LogRateLimiter limiter(std::chrono::seconds(10));
  int unanswered = 0;  // polls in a row
  while (true) {
    const PollResult result = Poll();
    unanswered = result == PollResult::kUnanswered ? unanswered + 1 : 0;
    const bool ready = result == PollResult::kServing ||
                       (ready_.load() && result == PollResult::kUnanswered && unanswered < kUnansweredPollsBeforeNotReady);
    if (ready_.exchange(ready) != ready) {
      ready_gauge_.Set(ready ? 1 : 0);
      spdlog::info("leader worker {} is {}", address_, ready ? "ready" : "not ready");
      if (on_ready_change_) on_ready_change_(ready);
    } else if (!ready) {
      if (long n = limiter.Allow()) spdlog::warn("waiting for leader worker {} ({} polls)", address_, n);
    }
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::FromChrono(poll_interval_));
    if (stopping_) return;
  }
}

}  // namespace nq::router
