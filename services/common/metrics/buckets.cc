#include "services/common/metrics/buckets.h"

#include <cmath>

#include "absl/base/internal/raw_logging.h"

namespace nq::metrics {

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  // Written as negated comparisons so NaN arguments fail too.
  if (!(start > 0.0) || !std::isfinite(start)) {
    ABSL_RAW_LOG(FATAL, "metrics: ExponentialBuckets start must be positive and finite, got %g",
                 start);
  }
  if (!(factor > 1.0) || !std::isfinite(factor)) {
    ABSL_RAW_LOG(FATAL, "metrics: ExponentialBuckets factor must be > 1 and finite, got %g",
                 factor);
  }
  if (count < 1) {
    ABSL_RAW_LOG(FATAL, "metrics: ExponentialBuckets count must be >= 1, got %d", count);
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  // Repeated multiplication, as client_golang does: exact for power-of-two factors.
  double bound = start;
  for (int i = 0; i < count; ++i) {
    if (!std::isfinite(bound)) {
      ABSL_RAW_LOG(FATAL, "metrics: ExponentialBuckets(%g, %g, %d) overflows at bound %d", start,
                   factor, count, i);
    }
    bounds.push_back(bound);
    bound *= factor;
  }
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  if (!std::isfinite(start)) {
    ABSL_RAW_LOG(FATAL, "metrics: LinearBuckets start must be finite, got %g", start);
  }
  if (!(width > 0.0) || !std::isfinite(width)) {
    ABSL_RAW_LOG(FATAL, "metrics: LinearBuckets width must be positive and finite, got %g", width);
  }
  if (count < 1) {
    ABSL_RAW_LOG(FATAL, "metrics: LinearBuckets count must be >= 1, got %d", count);
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  for (int i = 0; i < count; ++i) {
    const double bound = start + i * width;
    // A width below the spacing of doubles near `start` would repeat a bound.
    if (!std::isfinite(bound) || (i > 0 && !(bounds.back() < bound))) {
      ABSL_RAW_LOG(FATAL, "metrics: LinearBuckets(%g, %g, %d) is not strictly increasing/finite",
                   start, width, count);
    }
    bounds.push_back(bound);
  }
  return bounds;
}

}  // namespace nq::metrics
