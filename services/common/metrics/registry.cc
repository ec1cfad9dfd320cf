#include "services/common/metrics/registry.h"

#include <string>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_join.h"

namespace nq::metrics {

Registry::Registry() = default;
Registry::~Registry() = default;

Registry& Registry::Default() {
  static Registry* const registry = new Registry();
  return *registry;
}

CounterFamily& Registry::Counter(std::string_view name, std::string_view help,
                                 std::vector<std::string> label_names) {
  return GetOrCreate<metrics::Counter>(name, help, std::move(label_names), {});
}

GaugeFamily& Registry::Gauge(std::string_view name, std::string_view help,
                             std::vector<std::string> label_names) {
  return GetOrCreate<metrics::Gauge>(name, help, std::move(label_names), {});
}

HistogramFamily& Registry::Histogram(std::string_view name, std::string_view help,
                                     std::vector<double> bucket_upper_bounds,
                                     std::vector<std::string> label_names) {
  // Checked here as well as in the Histogram constructor because a labelled family creates no
  // child until first use, and the mistake should surface at registration.
  internal::CheckBucketUpperBounds(name, bucket_upper_bounds);
  return GetOrCreate<metrics::Histogram>(name, help, std::move(label_names),
                                         {std::move(bucket_upper_bounds)});
}

template <typename M>
Family<M>& Registry::GetOrCreate(std::string_view name, std::string_view help,
                                 std::vector<std::string> label_names,
                                 typename M::Options options) {
  absl::MutexLock lock(&mu_);
  if (auto it = families_.find(name); it != families_.end()) {
    FamilyBase& existing = *it->second;
    if (existing.type() != M::kType) {
      ABSL_RAW_LOG(FATAL, "metrics: %s registered as a %s, then as a %s", existing.name().c_str(),
                   TypeName(existing.type()).data(), TypeName(M::kType).data());
    }
    if (existing.label_names() != label_names) {
      ABSL_RAW_LOG(FATAL, "metrics: %s registered with labels {%s}, then with {%s}",
                   existing.name().c_str(), absl::StrJoin(existing.label_names(), ",").c_str(),
                   absl::StrJoin(label_names, ",").c_str());
    }
    // The type check above makes this downcast safe.
    auto& family = static_cast<Family<M>&>(existing);
    if (!(family.options() == options)) {
      ABSL_RAW_LOG(FATAL, "metrics: %s registered twice with different histogram buckets",
                   existing.name().c_str());
    }
    return family;
  }

  auto family = std::make_unique<Family<M>>(name, help, std::move(label_names), std::move(options));
  const std::vector<std::string> reserved = family->ReservedNames();
  for (const std::string& reserved_name : reserved) {
    if (auto owner = reserved_names_.find(reserved_name); owner != reserved_names_.end()) {
      ABSL_RAW_LOG(FATAL, "metrics: %s would write samples named %s, which %s already uses",
                   family->name().c_str(), reserved_name.c_str(), owner->second.c_str());
    }
  }
  for (const std::string& reserved_name : reserved) {
    reserved_names_.emplace(reserved_name, family->name());
  }
  Family<M>& result = *family;
  families_.emplace(std::string(name), std::move(family));
  return result;
}

std::string Registry::Serialize() const {
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->AppendTo(out);
  return out;
}

}  // namespace nq::metrics
