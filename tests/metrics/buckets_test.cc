#include "services/common/metrics/buckets.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace nq::metrics {
namespace {

using ::testing::DoubleEq;
using ::testing::ElementsAre;

TEST(ExponentialBucketsTest, PowersOfTwo) {
  EXPECT_THAT(ExponentialBuckets(1, 2, 5), ElementsAre(1, 2, 4, 8, 16));
}

TEST(ExponentialBucketsTest, FractionalStartAndFactor) {
  EXPECT_THAT(ExponentialBuckets(0.001, 10, 4),
              ElementsAre(DoubleEq(0.001), DoubleEq(0.01), DoubleEq(0.1), DoubleEq(1)));
}

TEST(ExponentialBucketsTest, SingleBucketIsStart) {
  EXPECT_THAT(ExponentialBuckets(0.5, 3, 1), ElementsAre(0.5));
}

TEST(LinearBucketsTest, EvenSteps) {
  EXPECT_THAT(LinearBuckets(0, 5, 4), ElementsAre(0, 5, 10, 15));
}

TEST(LinearBucketsTest, NegativeStart) {
  EXPECT_THAT(LinearBuckets(-1, 0.5, 5), ElementsAre(-1, -0.5, 0, 0.5, 1));
}

TEST(LinearBucketsTest, ComputesEachBoundFromStartWithoutAccumulatingError) {
  const std::vector<double> bounds = LinearBuckets(0.1, 0.1, 10);
  ASSERT_EQ(bounds.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(bounds[i], 0.1 + i * 0.1) << "bound " << i;
}

}  // namespace
}  // namespace nq::metrics
