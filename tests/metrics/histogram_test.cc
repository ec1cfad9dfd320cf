#include "services/common/metrics/histogram.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace nq::metrics {
namespace {

using ::testing::ElementsAre;

TEST(HistogramTest, EmptySnapshot) {
  Histogram histogram({.bucket_upper_bounds = {1, 2}});
  const HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_THAT(snapshot.bucket_upper_bounds, ElementsAre(1, 2));
  EXPECT_THAT(snapshot.cumulative_counts, ElementsAre(0, 0, 0));
  EXPECT_EQ(snapshot.count, 0u);
  EXPECT_EQ(snapshot.sum, 0.0);
}

TEST(HistogramTest, CountsAreCumulativeAndEndWithInf) {
  Histogram histogram({.bucket_upper_bounds = {1, 2, 4}});
  for (double v : {0.5, 1.5, 1.7, 3.0, 100.0}) histogram.Observe(v);
  const HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_THAT(snapshot.cumulative_counts, ElementsAre(1, 3, 4, 5));
  EXPECT_EQ(snapshot.count, 5u);
  EXPECT_DOUBLE_EQ(snapshot.sum, 106.7);
}

TEST(HistogramTest, BoundIsInclusive) {
  // Prometheus buckets are `le` (less than or equal).
  Histogram histogram({.bucket_upper_bounds = {1, 2}});
  histogram.Observe(1);
  histogram.Observe(2);
  EXPECT_THAT(histogram.Snapshot().cumulative_counts, ElementsAre(1, 2, 2));
}

TEST(HistogramTest, ValuesBelowFirstBoundGoToFirstBucket) {
  Histogram histogram({.bucket_upper_bounds = {0, 10}});
  histogram.Observe(-5);
  histogram.Observe(-std::numeric_limits<double>::infinity());
  EXPECT_THAT(histogram.Snapshot().cumulative_counts, ElementsAre(2, 2, 2));
}

TEST(HistogramTest, InfinityGoesToInfBucketOnly) {
  Histogram histogram({.bucket_upper_bounds = {1}});
  histogram.Observe(std::numeric_limits<double>::infinity());
  const HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_THAT(snapshot.cumulative_counts, ElementsAre(0, 1));
  EXPECT_EQ(snapshot.sum, std::numeric_limits<double>::infinity());
}

TEST(HistogramTest, NanGoesToInfBucketAndPoisonsSum) {
  Histogram histogram({.bucket_upper_bounds = {1, 2}});
  histogram.Observe(0.5);
  histogram.Observe(std::nan(""));
  const HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_THAT(snapshot.cumulative_counts, ElementsAre(1, 1, 2));
  EXPECT_EQ(snapshot.count, 2u);
  EXPECT_TRUE(std::isnan(snapshot.sum));
}

}  // namespace
}  // namespace nq::metrics
