#include "services/worker/routing_watchers.h"

#include <algorithm>

#include "services/common/metrics/registry.h"

namespace nq::worker {

std::optional<nq::v1::RoutingReport> RoutingWatchers::Watcher::Next(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !queue_.empty(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) return std::nullopt;
  nq::v1::RoutingReport report = std::move(queue_.front());
  queue_.pop_front();
  return report;
}

uint64_t RoutingWatchers::Watcher::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void RoutingWatchers::Watcher::Push(const nq::v1::RoutingReport& report) {
  static metrics::Counter& dropped = metrics::Registry::Default()
                                         .Counter("nq_worker_routing_watch_dropped_total",
                                                  "Routing blocks a slow WatchRouting client lost")
                                         .Get();
  absl::MutexLock lock(&mu_);
  if (queue_.size() >= capacity_) {
    queue_.pop_front();
    ++dropped_;
    dropped.Increment();
  }
  queue_.push_back(report);
}

std::shared_ptr<RoutingWatchers::Watcher> RoutingWatchers::Add(size_t capacity) {
  auto watcher = std::make_shared<Watcher>(capacity);
  absl::MutexLock lock(&mu_);
  watchers_.push_back(watcher);
  return watcher;
}

void RoutingWatchers::Remove(const std::shared_ptr<Watcher>& watcher) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(std::remove(watchers_.begin(), watchers_.end(), watcher), watchers_.end());
}

void RoutingWatchers::Publish(const nq::v1::RoutingReport& report) {
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<Watcher>& watcher : watchers_) watcher->Push(report);
}

bool RoutingWatchers::empty() const {
  absl::MutexLock lock(&mu_);
  return watchers_.empty();
}

}  // namespace nq::worker
