// Fan-out of the worker's routing blocks to `nq trace --worker` clients (nq.v1.Worker
// WatchRouting). Publishing copies a block into each watcher's bounded queue and never
// blocks: a watcher that falls behind loses its oldest blocks, counted.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nq/v1/streamer.pb.h"

namespace nq::worker {

class RoutingWatchers {
 public:
  class Watcher {
   public:
    explicit Watcher(size_t capacity) : capacity_(capacity) {}
    // The next block, or nullopt after `timeout`.
    std::optional<nq::v1::RoutingReport> Next(absl::Duration timeout);
    uint64_t dropped() const;

   private:
    friend class RoutingWatchers;
    void Push(const nq::v1::RoutingReport& report);
    const size_t capacity_;
    mutable absl::Mutex mu_;
    std::deque<nq::v1::RoutingReport> queue_ ABSL_GUARDED_BY(mu_);
    uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  };

  std::shared_ptr<Watcher> Add(size_t capacity = 1024);
  void Remove(const std::shared_ptr<Watcher>& watcher);
  void Publish(const nq::v1::RoutingReport& report);
  bool empty() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Watcher>> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace nq::worker
