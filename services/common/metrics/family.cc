#include "services/common/metrics/family.h"

#include <set>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "services/common/metrics/exposition.h"
#include "services/common/metrics/names.h"

namespace nq::metrics {
namespace {

// The label Prometheus uses for histogram bucket bounds.
constexpr std::string_view kBucketLabel = "le";

}  // namespace

FamilyBase::FamilyBase(std::string_view name, std::string_view help, MetricType type,
                       std::vector<std::string> label_names)
    : name_(name), help_(help), type_(type), label_names_(std::move(label_names)) {
  if (!IsValidMetricName(name_)) {
    ABSL_RAW_LOG(FATAL, "metrics: invalid metric name \"%s\"; must match [a-zA-Z_:][a-zA-Z0-9_:]*",
                 name_.c_str());
  }
  std::set<std::string_view> seen;
  for (const std::string& label : label_names_) {
    if (!IsValidLabelName(label)) {
      ABSL_RAW_LOG(FATAL,
                   "metrics: %s has invalid label name \"%s\"; must match [a-zA-Z_][a-zA-Z0-9_]* "
                   "and not start with __",
                   name_.c_str(), label.c_str());
    }
    if (type_ == MetricType::kHistogram && label == kBucketLabel) {
      ABSL_RAW_LOG(FATAL, "metrics: histogram %s may not use the label name \"le\"", name_.c_str());
    }
    if (!seen.insert(label).second) {
      ABSL_RAW_LOG(FATAL, "metrics: %s repeats the label name \"%s\"", name_.c_str(),
                   label.c_str());
    }
  }
}

std::vector<std::string> FamilyBase::ReservedNames() const {
  if (type_ == MetricType::kHistogram) {
    return {name_, absl::StrCat(name_, "_bucket"), absl::StrCat(name_, "_sum"),
            absl::StrCat(name_, "_count")};
  }
  return {name_};
}

void FamilyBase::CheckLabelValueCount(const std::vector<std::string>& values) const {
  if (values.size() != label_names_.size()) {
    ABSL_RAW_LOG(FATAL, "metrics: %s takes %zu label values, got %zu", name_.c_str(),
                 label_names_.size(), values.size());
  }
}

template <typename M>
Family<M>::Family(std::string_view name, std::string_view help,
                  std::vector<std::string> label_names, Options options)
    : FamilyBase(name, help, M::kType, std::move(label_names)), options_(std::move(options)) {
  // `this->`: the constructor parameter of the same name has been moved from.
  if (this->label_names().empty()) {
    absl::MutexLock lock(&mu_);
    auto child = std::make_unique<M>(options_);
    unlabelled_child_ = child.get();
    children_.emplace(std::vector<std::string>(), std::move(child));
  }
}

template <typename M>
M& Family<M>::WithLabels(std::vector<std::string> values) {
  CheckLabelValueCount(values);
  if (unlabelled_child_ != nullptr) return *unlabelled_child_;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = children_.find(values);
    if (it != children_.end()) return *it->second;
  }
  absl::MutexLock lock(&mu_);
  // Another thread may have created the child between the two locks; try_emplace keeps theirs.
  auto [it, inserted] = children_.try_emplace(std::move(values), nullptr);
  if (inserted) it->second = std::make_unique<M>(options_);
  return *it->second;
}

template <typename M>
M& Family<M>::Get() {
  if (unlabelled_child_ == nullptr) {
    ABSL_RAW_LOG(FATAL, "metrics: %s has %zu labels; use WithLabels, not Get", name().c_str(),
                 label_names().size());
  }
  return *unlabelled_child_;
}

template <typename M>
void Family<M>::AppendTo(std::string& out) const {
  internal::AppendHeader(name(), help(), M::kType, out);
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [values, child] : children_) {
    internal::AppendSamples(name(), internal::FormatLabels(label_names(), values), *child, out);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace nq::metrics
