// Admission for the single-sequence worker (DESIGN.md section 2): one request runs, up to
// `max_waiting` wait in arrival order, the rest are refused at once (RESOURCE_EXHAUSTED ->
// HTTP 429). A waiter that is cancelled or passes its deadline leaves the queue.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "services/common/metrics/registry.h"

namespace nq::router {

class Scheduler {
 public:
  // Releases the running slot when destroyed.
  class Slot {
   public:
    Slot(Slot&& other) noexcept : scheduler_(std::exchange(other.scheduler_, nullptr)) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot();

   private:
    friend class Scheduler;
    explicit Slot(Scheduler* scheduler) : scheduler_(scheduler) {}
    Scheduler* scheduler_;
  };

  Scheduler(size_t max_waiting, metrics::Registry& metrics);

  // Returns once the caller may run. RESOURCE_EXHAUSTED when max_waiting requests already
  // wait; CANCELLED when `cancelled()` turns true while waiting; DEADLINE_EXCEEDED when
  // `deadline` passes first.
  absl::StatusOr<Slot> Admit(const std::function<bool()>& cancelled,
                             std::chrono::steady_clock::time_point deadline);

  size_t waiting() const;
  bool running() const;

 private:
  void Release();
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_waiting_;
  mutable absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  metrics::Gauge& running_gauge_;
  metrics::Gauge& waiting_gauge_;
  metrics::Histogram& queue_time_;
  metrics::Counter& rejected_;
};

}  // namespace nq::router
