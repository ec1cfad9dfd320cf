#include "services/common/metrics/histogram.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/base/internal/raw_logging.h"

namespace nq::metrics {

Histogram::Histogram(Options options)
    : upper_bounds_(std::move(options.bucket_upper_bounds)),
      bucket_counts_(std::make_unique<std::atomic<uint64_t>[]>(upper_bounds_.size() + 1)) {
  internal::CheckBucketUpperBounds("<histogram>", upper_bounds_);
}

void Histogram::Observe(double v) {
  // The first bound >= v. NaN compares false with everything, so lower_bound would put it in
  // the first bucket; it stays in +Inf instead.
  size_t index = upper_bounds_.size();
  if (!std::isnan(v)) {
    index = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), v) - upper_bounds_.begin();
  }
  bucket_counts_[index].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

HistogramSnapshot Histogram::Snapshot() const {
  HistogramSnapshot snapshot;
  snapshot.bucket_upper_bounds = upper_bounds_;
  snapshot.cumulative_counts.reserve(upper_bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    running += bucket_counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts.push_back(running);
  }
  snapshot.count = running;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

namespace internal {

void CheckBucketUpperBounds(std::string_view metric_name, const std::vector<double>& bounds) {
  const std::string name(metric_name);
  if (bounds.empty()) {
    ABSL_RAW_LOG(FATAL,
                 "metrics: histogram %s has no buckets; use ExponentialBuckets or LinearBuckets",
                 name.c_str());
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      // +Inf is always implied; listing it (or NaN) is a mistake in the caller's layout.
      ABSL_RAW_LOG(FATAL, "metrics: histogram %s bucket bound %zu is %g; bounds must be finite",
                   name.c_str(), i, bounds[i]);
    }
    if (i > 0 && !(bounds[i - 1] < bounds[i])) {
      ABSL_RAW_LOG(FATAL,
                   "metrics: histogram %s bucket bounds must be strictly increasing, "
                   "got %.17g then %.17g",
                   name.c_str(), bounds[i - 1], bounds[i]);
    }
  }
}

}  // namespace internal
}  // namespace nq::metrics
