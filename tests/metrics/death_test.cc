// Misuse of the metrics API is a programming error and must abort loudly, never continue.
#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "services/common/metrics/registry.h"

namespace nq::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

class MetricsDeathTest : public ::testing::Test {
 protected:
  // Other suites in this binary start threads; "threadsafe" re-executes the binary for each
  // death test instead of forking a possibly multi-threaded process.
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
  Registry registry_;
};

TEST_F(MetricsDeathTest, InvalidMetricName) {
  EXPECT_DEATH(registry_.Counter("", "X."), "invalid metric name");
  EXPECT_DEATH(registry_.Counter("1abc_total", "X."), "invalid metric name \"1abc_total\"");
  EXPECT_DEATH(registry_.Gauge("nq-dash", "X."), "invalid metric name");
  EXPECT_DEATH(registry_.Histogram("nq h", "X.", {1}), "invalid metric name");
}

TEST_F(MetricsDeathTest, InvalidLabelName) {
  EXPECT_DEATH(registry_.Counter("nq_x_total", "X.", {"1a"}), "invalid label name \"1a\"");
  EXPECT_DEATH(registry_.Counter("nq_x_total", "X.", {"a:b"}), "invalid label name");
  EXPECT_DEATH(registry_.Counter("nq_x_total", "X.", {""}), "invalid label name");
}

TEST_F(MetricsDeathTest, ReservedLabelName) {
  EXPECT_DEATH(registry_.Gauge("nq_g", "G.", {"__name__"}), "invalid label name \"__name__\"");
}

TEST_F(MetricsDeathTest, RepeatedLabelName) {
  EXPECT_DEATH(registry_.Gauge("nq_g", "G.", {"a", "b", "a"}), "repeats the label name \"a\"");
}

TEST_F(MetricsDeathTest, HistogramLeLabel) {
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {1}, {"model", "le"}),
               "may not use the label name \"le\"");
}

TEST_F(MetricsDeathTest, LeLabelIsFineOutsideHistograms) {
  registry_.Gauge("nq_g", "G.", {"le"}).WithLabels({"1"}).Set(1);
  EXPECT_EQ(registry_.Gauge("nq_g", "G.", {"le"}).WithLabels({"1"}).Value(), 1);
}

TEST_F(MetricsDeathTest, SameNameAnotherType) {
  registry_.Counter("nq_x_total", "X.");
  EXPECT_DEATH(registry_.Gauge("nq_x_total", "X."),
               "nq_x_total registered as a counter, then as a gauge");
}

TEST_F(MetricsDeathTest, SameNameOtherLabels) {
  registry_.Counter("nq_x_total", "X.", {"a", "b"});
  EXPECT_DEATH(registry_.Counter("nq_x_total", "X.", {"b", "a"}),
               "registered with labels \\{a,b\\}, then with \\{b,a\\}");
  EXPECT_DEATH(registry_.Counter("nq_x_total", "X."), "registered with labels");
}

TEST_F(MetricsDeathTest, SameHistogramOtherBuckets) {
  registry_.Histogram("nq_h_seconds", "H.", {1, 2});
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {1, 3}), "different histogram buckets");
}

TEST_F(MetricsDeathTest, HistogramSampleNamesCollideWithOtherFamilies) {
  registry_.Histogram("nq_h_seconds", "H.", {1});
  EXPECT_DEATH(registry_.Gauge("nq_h_seconds_count", "G."),
               "samples named nq_h_seconds_count, which nq_h_seconds already uses");
  registry_.Counter("nq_y_sum", "Y.");
  EXPECT_DEATH(registry_.Histogram("nq_y", "Y.", {1}), "which nq_y_sum already uses");
}

TEST_F(MetricsDeathTest, BadBucketBounds) {
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {}), "has no buckets");
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {1, 1}), "strictly increasing");
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {2, 1}), "strictly increasing");
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {1, kInf}), "must be finite");
  EXPECT_DEATH(registry_.Histogram("nq_h_seconds", "H.", {std::nan("")}), "must be finite");
  EXPECT_DEATH(Histogram({.bucket_upper_bounds = {3, 2}}), "strictly increasing");
}

TEST_F(MetricsDeathTest, WrongNumberOfLabelValues) {
  CounterFamily& family = registry_.Counter("nq_x_total", "X.", {"a", "b"});
  EXPECT_DEATH(family.WithLabels({"1"}), "nq_x_total takes 2 label values, got 1");
  EXPECT_DEATH(family.WithLabels({"1", "2", "3"}), "takes 2 label values, got 3");
  GaugeFamily& unlabelled = registry_.Gauge("nq_g", "G.");
  EXPECT_DEATH(unlabelled.WithLabels({"1"}), "nq_g takes 0 label values, got 1");
}

TEST_F(MetricsDeathTest, GetOnLabelledFamily) {
  HistogramFamily& family = registry_.Histogram("nq_h_seconds", "H.", {1}, {"a"});
  EXPECT_DEATH(family.Get(), "nq_h_seconds has 1 labels; use WithLabels");
}

TEST_F(MetricsDeathTest, CounterGoesDown) {
  Counter& counter = registry_.Counter("nq_x_total", "X.").Get();
  EXPECT_DEATH(counter.Increment(-1), "counters only go up");
  EXPECT_DEATH(counter.Increment(std::nan("")), "counters only go up");
}

TEST_F(MetricsDeathTest, BadExponentialBuckets) {
  EXPECT_DEATH(ExponentialBuckets(0, 2, 3), "start must be positive");
  EXPECT_DEATH(ExponentialBuckets(-1, 2, 3), "start must be positive");
  EXPECT_DEATH(ExponentialBuckets(1, 1, 3), "factor must be > 1");
  EXPECT_DEATH(ExponentialBuckets(1, 2, 0), "count must be >= 1");
  EXPECT_DEATH(ExponentialBuckets(1e300, 1e10, 3), "overflows");
}

TEST_F(MetricsDeathTest, BadLinearBuckets) {
  EXPECT_DEATH(LinearBuckets(0, 0, 3), "width must be positive");
  EXPECT_DEATH(LinearBuckets(0, -1, 3), "width must be positive");
  EXPECT_DEATH(LinearBuckets(kInf, 1, 3), "start must be finite");
  EXPECT_DEATH(LinearBuckets(0, 1, 0), "count must be >= 1");
  EXPECT_DEATH(LinearBuckets(1e20, 1, 3), "not strictly increasing");
}

}  // namespace
}  // namespace nq::metrics
