#include "services/common/metrics/counter.h"

#include "absl/base/internal/raw_logging.h"
#include "absl/base/optimization.h"

namespace nq::metrics {

void Counter::Increment(double v) {
  // `!(v >= 0)` also catches NaN, which would poison the counter forever.
  if (ABSL_PREDICT_FALSE(!(v >= 0.0))) {
    ABSL_RAW_LOG(FATAL, "metrics: counter incremented by %g; counters only go up", v);
  }
  value_.fetch_add(v, std::memory_order_relaxed);
}

}  // namespace nq::metrics
