// Syntax rules for metric and label names, from the Prometheus data model
// (https://prometheus.io/docs/concepts/data_model/).
#pragma once

#include <string_view>

namespace nq::metrics {

// [a-zA-Z_:][a-zA-Z0-9_:]*  (colons are meant for recording rules, but are legal).
bool IsValidMetricName(std::string_view name);

// [a-zA-Z_][a-zA-Z0-9_]* and not starting with "__", which Prometheus reserves for itself.
bool IsValidLabelName(std::string_view name);

}  // namespace nq::metrics
