// The router's link to the leader worker: one channel, and a watcher that polls the
// worker's grpc.health.v1 status and GetInfo so the router knows whether it can serve.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "services/common/internal_tls.h"

#include "absl/synchronization/mutex.h"
#include "nq/v1/worker.grpc.pb.h"
#include "services/common/metrics/registry.h"

namespace nq::router {

class WorkerConnection {
 public:
  // A worker that says NOT_SERVING is not ready at once; one that does not answer (deadline,
  // connection refused) only after this many polls in a row, so one slow poll on a loaded host
  // does not take the cluster out of service (a dead worker is seen one interval later).
  static constexpr int kUnansweredPollsBeforeNotReady = 2;

  // `on_ready_change(ready)` runs on the watcher thread whenever readiness flips.
  WorkerConnection(std::string address, std::chrono::milliseconds poll_interval,
                   std::function<void(bool)> on_ready_change,
                   std::shared_ptr<const InternalTls> tls = nullptr);
  ~WorkerConnection();
  WorkerConnection(const WorkerConnection&) = delete;
  WorkerConnection& operator=(const WorkerConnection&) = delete;

  void Start();
  void Stop();

  // The worker answered SERVING on its last health check (or its last answer was SERVING and
  // fewer than kUnansweredPollsBeforeNotReady polls since went unanswered).
  bool ready() const { return ready_.load(); }
  // The last GetInfo answer from a ready worker.
  std::optional<nq::v1::WorkerInfo> info() const;
  nq::v1::Worker::Stub* stub() { return stub_.get(); }
  const std::string& address() const { return address_; }

 private:
  enum class PollResult { kServing, kNotServing, kUnanswered };
  void Watch();
  PollResult Poll();

  const std::string address_;
  const std::chrono::milliseconds poll_interval_;
  const std::function<void(bool)> on_ready_change_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<nq::v1::Worker::Stub> stub_;
  std::atomic<bool> ready_{false};
  metrics::Gauge& ready_gauge_;

  mutable absl::Mutex mu_;
  std::optional<nq::v1::WorkerInfo> info_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace nq::router
