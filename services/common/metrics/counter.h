// A monotonically increasing value (requests served, bytes read). By project convention
// (DESIGN.md section 8) counter family names end in `_total` and use base units; promtool's
// linter flags names that don't, but this library does not enforce it.
#pragma once

#include <atomic>

#include "services/common/metrics/metric_type.h"

namespace nq::metrics {

// Thread-safe and lock-free: Increment is a single atomic read-modify-write, so hot paths may
// call it freely. Obtain instances from CounterFamily; they live as long as their Registry.
class Counter {
 public:
  static constexpr MetricType kType = MetricType::kCounter;
  // What every child of a family shares; counters need nothing.
  struct Options {
    bool operator==(const Options&) const = default;
  };

  Counter() = default;
  explicit Counter(const Options& /*options*/) {}
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `v`. A negative or NaN `v` would break monotonicity (Prometheus reads any decrease as
  // a process restart), so it is a programming error and aborts.
  void Increment(double v = 1.0);

  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  static_assert(std::atomic<double>::is_always_lock_free);
  // Relaxed ordering throughout: a counter orders nothing else, readers only need some recent
  // value, and fetch_add never loses an increment.
  std::atomic<double> value_{0.0};
};

}  // namespace nq::metrics
