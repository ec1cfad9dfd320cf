// A value that goes up and down (queue depth, requests running, bytes in flight).
#pragma once

#include <atomic>

#include "services/common/metrics/metric_type.h"

namespace nq::metrics {

// Thread-safe and lock-free: every mutator is one atomic operation. Obtain instances from
// GaugeFamily; they live as long as their Registry.
class Gauge {
 public:
  static constexpr MetricType kType = MetricType::kGauge;
  // What every child of a family shares; gauges need nothing.
  struct Options {
    bool operator==(const Options&) const = default;
  };

  Gauge() = default;
  explicit Gauge(const Options& /*options*/) {}
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void Decrement(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  static_assert(std::atomic<double>::is_always_lock_free);
  // Relaxed: a gauge orders nothing else; see Counter.
  std::atomic<double> value_{0.0};
};

}  // namespace nq::metrics
