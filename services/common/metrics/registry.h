// Process metrics in the Prometheus text exposition format 0.0.4. Usage:
//
//   auto& tokens = nq::metrics::Registry::Default()
//                      .Counter("nq_generation_tokens_total", "Tokens generated.")
//                      .Get();
//   tokens.Increment(n);  // Lock-free; keep the reference, don't look it up per call.
//
//   // In the /metrics handler, with Content-Type nq::metrics::kContentType:
//   return nq::metrics::Registry::Default().Serialize();
//
// Conventions (DESIGN.md section 8, checked by `promtool check metrics`, not by this library):
// names start with `nq_`, use base units (`_seconds`, `_bytes`), counters end in `_total`, and
// labels have a small bounded set of values, because every distinct value is a new time
// series held forever by this process and by Prometheus.
//
// Misuse -- an invalid name, the same name registered twice with a different type, labels or
// buckets, a wrong number of label values, a negative counter increment -- is a programming
// error and aborts with a message; it is never silently accepted.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "services/common/metrics/buckets.h"
#include "services/common/metrics/counter.h"
#include "services/common/metrics/family.h"
#include "services/common/metrics/gauge.h"
#include "services/common/metrics/histogram.h"

namespace nq::metrics {

// The HTTP Content-Type of Registry::Serialize output.
inline constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Owns metric families. Thread-safe: registration and Serialize take a mutex; updating a
// metric never does. Families and their children live as long as the registry.
class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The process-wide registry services expose at /metrics. Never destroyed, so metric
  // references stay valid even in static destructors and detached threads at exit.
  static Registry& Default();

  // Each returns the family called `name`, creating it on first call; a later call with the
  // same name, type and label names (and, for histograms, buckets) returns the same family,
  // keeping the first call's help text. Names must match [a-zA-Z_:][a-zA-Z0-9_:]*, label names
  // [a-zA-Z_][a-zA-Z0-9_]* without a leading "__"; histograms may not use the label "le".
  CounterFamily& Counter(std::string_view name, std::string_view help,
                         std::vector<std::string> label_names = {});
  GaugeFamily& Gauge(std::string_view name, std::string_view help,
                     std::vector<std::string> label_names = {});
  // `bucket_upper_bounds`: finite, strictly increasing, non-empty (+Inf is implied); see
  // ExponentialBuckets and LinearBuckets.
  HistogramFamily& Histogram(std::string_view name, std::string_view help,
                             std::vector<double> bucket_upper_bounds,
                             std::vector<std::string> label_names = {});

  // The full text exposition: families sorted by name, each family's children sorted by label
  // values.
  std::string Serialize() const;

 private:
  template <typename M>
  Family<M>& GetOrCreate(std::string_view name, std::string_view help,
                         std::vector<std::string> label_names, typename M::Options options);

  mutable absl::Mutex mu_;
  // std::map keeps families sorted by name for Serialize.
  std::map<std::string, std::unique_ptr<FamilyBase>, std::less<>> families_ ABSL_GUARDED_BY(mu_);
  // Every name from FamilyBase::ReservedNames of every family, mapped to the family's name.
  std::map<std::string, std::string, std::less<>> reserved_names_ ABSL_GUARDED_BY(mu_);
};

}  // namespace nq::metrics
