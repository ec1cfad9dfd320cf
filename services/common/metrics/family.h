// A metric family: one name, help text and type, with one child metric per combination of
// label values (`nq_expert_calls_total{bits="4"}` is the child {"4"} of a family labelled
// {"bits"}).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "services/common/metrics/counter.h"
#include "services/common/metrics/gauge.h"
#include "services/common/metrics/histogram.h"
#include "services/common/metrics/metric_type.h"

namespace nq::metrics {

// What Registry needs from a family regardless of its metric type.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // The family name plus the metric names its sample lines use (for a histogram, the `_bucket`,
  // `_sum` and `_count` names). Two families in one exposition may not share any of them, or
  // a scraper could not tell whose sample a line is.
  std::vector<std::string> ReservedNames() const;

  // Appends `# HELP`, `# TYPE` and the samples of every child, children ordered by their label
  // values, in the text exposition format.
  virtual void AppendTo(std::string& out) const = 0;

 protected:
  // Aborts on an invalid metric name, an invalid, reserved or repeated label name, or `le` on
  // a histogram (it is the bucket label).
  FamilyBase(std::string_view name, std::string_view help, MetricType type,
             std::vector<std::string> label_names);

  // Aborts unless `values` has one entry per label name.
  void CheckLabelValueCount(const std::vector<std::string>& values) const;

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// The family of metric type M (Counter, Gauge or Histogram). Obtain families from Registry.
// Children are created on first use and never removed, so references stay valid for the life
// of the family; look a child up once and keep the reference on hot paths.
template <typename M>
class Family final : public FamilyBase {
 public:
  using Options = typename M::Options;

  // An unlabelled family creates its only child here, so a freshly started service exposes a
  // zero sample instead of nothing.
  Family(std::string_view name, std::string_view help, std::vector<std::string> label_names,
         Options options);

  // The child for `values` (parallel to label_names()), created on first use. Takes a lock;
  // aborts if the number of values is wrong.
  M& WithLabels(std::vector<std::string> values);

  // The child of a family without labels; lock-free. Aborts if the family has labels.
  M& Get();

  const Options& options() const { return options_; }

  void AppendTo(std::string& out) const override;

 private:
  const Options options_;
  // Set in the constructor for unlabelled families and never changed, so Get() reads it
  // without the lock.
  M* unlabelled_child_ = nullptr;

  // Guards creation and iteration of children; the children themselves are atomic.
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> children_ ABSL_GUARDED_BY(mu_);
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

}  // namespace nq::metrics
