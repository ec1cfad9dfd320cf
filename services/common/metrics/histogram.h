// A distribution of observations (latencies, sizes) counted into fixed buckets, exposed as
// cumulative `_bucket{le="..."}` samples plus `_sum` and `_count`.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "services/common/metrics/metric_type.h"

namespace nq::metrics {

// A point-in-time copy of a Histogram, for exposition and tests.
struct HistogramSnapshot {
  // The finite bucket bounds; the implicit +Inf bucket is not listed.
  std::vector<double> bucket_upper_bounds;
  // Observations <= each bound, in the order of `bucket_upper_bounds`, followed by one entry for
  // +Inf; the last entry always equals `count`.
  std::vector<uint64_t> cumulative_counts;
  double sum = 0.0;
  uint64_t count = 0;
};

// Thread-safe and lock-free: Observe is a binary search plus two atomic operations. Obtain
// instances from HistogramFamily; they live as long as their Registry.
class Histogram {
 public:
  static constexpr MetricType kType = MetricType::kHistogram;
  // What every child of a family shares: the bucket layout.
  struct Options {
    // Finite, strictly increasing, non-empty; +Inf is implied and must not be listed.
    std::vector<double> bucket_upper_bounds;
    bool operator==(const Options&) const = default;
  };

  // Aborts if `options.bucket_upper_bounds` breaks the contract above.
  explicit Histogram(Options options);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Counts `v` in the first bucket whose bound is >= v (Prometheus `le` semantics) and adds it
  // to the sum. NaN is counted only in the +Inf bucket and makes the sum NaN, as client_golang
  // does, so a bad measurement is visible rather than silently dropped.
  void Observe(double v);

  // Observations racing with Snapshot may be reflected in the buckets but not yet in the sum
  // (or the reverse); `count` is derived from the buckets so the exposition is always
  // internally consistent (`le="+Inf"` == `_count`).
  HistogramSnapshot Snapshot() const;

  const std::vector<double>& bucket_upper_bounds() const { return upper_bounds_; }

 private:
  static_assert(std::atomic<double>::is_always_lock_free);
  static_assert(std::atomic<uint64_t>::is_always_lock_free);

  const std::vector<double> upper_bounds_;
  // Per-bucket (not cumulative) counts, so Observe touches one slot; index upper_bounds_.size()
  // is the +Inf overflow bucket. Relaxed ordering: see Counter.
  const std::unique_ptr<std::atomic<uint64_t>[]> bucket_counts_;
  std::atomic<double> sum_{0.0};
};

namespace internal {

// Aborts, naming `metric_name`, unless `bounds` is non-empty, finite and strictly increasing.
void CheckBucketUpperBounds(std::string_view metric_name, const std::vector<double>& bounds);

}  // namespace internal
}  // namespace nq::metrics
