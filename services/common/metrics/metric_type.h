// The three Prometheus metric types this library implements, and their exposition names.
#pragma once

#include <string_view>

namespace nq::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// The word used on the `# TYPE` line of the text exposition format.
constexpr std::string_view TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace nq::metrics
