// Prometheus text exposition format 0.0.4, the pieces Family and Registry assemble:
// https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
// Internal to the metrics library; services call Registry::Serialize.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "services/common/metrics/counter.h"
#include "services/common/metrics/gauge.h"
#include "services/common/metrics/histogram.h"
#include "services/common/metrics/metric_type.h"

namespace nq::metrics::internal {

// The shortest decimal that parses back to exactly `v` (std::to_chars), or the format's
// spellings `+Inf`, `-Inf`, `NaN`.
void AppendValue(double v, std::string& out);
std::string FormatValue(double v);

// HELP text escapes `\` and newline. Label values additionally escape `"`. Both replace bytes
// that are not valid UTF-8 with U+FFFD: Prometheus rejects a whole scrape over one invalid
// label value, so one bad value must not blind monitoring of the entire process.
std::string EscapeHelp(std::string_view help);
std::string EscapeLabelValue(std::string_view value);

// `a="x",b="y"` without braces, or "" for no labels; `names` and `values` are parallel.
std::string FormatLabels(const std::vector<std::string>& names,
                         const std::vector<std::string>& values);

// The `# HELP` and `# TYPE` lines that open a family.
void AppendHeader(std::string_view name, std::string_view help, MetricType type, std::string& out);

// The sample lines of one child; `labels` comes from FormatLabels.
void AppendSamples(std::string_view name, std::string_view labels, const Counter& counter,
                   std::string& out);
void AppendSamples(std::string_view name, std::string_view labels, const Gauge& gauge,
                   std::string& out);
void AppendSamples(std::string_view name, std::string_view labels, const Histogram& histogram,
                   std::string& out);

}  // namespace nq::metrics::internal
