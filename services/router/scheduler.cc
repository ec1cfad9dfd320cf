#include "services/router/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace nq::router {
namespace {

// How often a waiter re-checks its cancellation; a disconnected client leaves the queue
// within this time.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

}  // namespace

Scheduler::Slot::~Slot() {
  if (scheduler_ != nullptr) scheduler_->Release();
}

Scheduler::Scheduler(size_t max_waiting, metrics::Registry& metrics)
    : max_waiting_(max_waiting),
      running_gauge_(metrics.Gauge("nq_num_requests_running", "Requests running on the worker").Get()),
      waiting_gauge_(metrics.Gauge("nq_num_requests_waiting", "Requests waiting in the router's queue").Get()),
      queue_time_(metrics.Histogram("nq_request_queue_time_seconds", "Time requests spent waiting in the queue",
                                    metrics::ExponentialBuckets(0.001, 2, 18))
                      .Get()),
      rejected_(metrics.Counter("nq_requests_rejected_total", "Requests refused because the queue was full").Get()) {}

absl::StatusOr<Scheduler::Slot> Scheduler::Admit(const std::function<bool()>& cancelled,
                                                 std::chrono::steady_clock::time_point deadline) {
  const auto arrived = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  if (running_ || !queue_.empty()) {
    if (queue_.size() >= max_waiting_) {
      rejected_.Increment();
      return absl::ResourceExhaustedError(
          absl::StrCat("the server is busy: ", queue_.size(), " requests are already waiting (limit ",
                       max_waiting_, "); retry later"));
    }
    const uint64_t ticket = next_ticket_++;
    queue_.push_back(ticket);
    UpdateGaugesLocked();
    auto my_turn = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !running_ && queue_.front() == ticket; };
    while (!my_turn()) {
      mu_.AwaitWithTimeout(absl::Condition(&my_turn), kCancelPoll);
      if (my_turn()) break;
      const bool expired = std::chrono::steady_clock::now() >= deadline;
      if (expired || cancelled()) {
        queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
        UpdateGaugesLocked();
        return expired ? absl::DeadlineExceededError("the request's deadline passed while it waited in the queue")
                       : absl::CancelledError("the client went away while the request waited in the queue");
      }
    }
    queue_.pop_front();
  }
  running_ = true;
  UpdateGaugesLocked();
  queue_time_.Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived).count());
  return Slot(this);
}

void Scheduler::Release() {
  absl::MutexLock lock(&mu_);
  running_ = false;
  UpdateGaugesLocked();
}

size_t Scheduler::waiting() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

bool Scheduler::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

void Scheduler::UpdateGaugesLocked() {
  running_gauge_.Set(running_ ? 1 : 0);
  waiting_gauge_.Set(static_cast<double>(queue_.size()));
}

}  // namespace nq::router
