#include <limits>

#include "gtest/gtest.h"
#include "services/common/metrics/counter.h"
#include "services/common/metrics/gauge.h"

namespace nq::metrics {
namespace {

TEST(CounterTest, StartsAtZero) {
  Counter counter;
  EXPECT_EQ(counter.Value(), 0.0);
}

TEST(CounterTest, IncrementDefaultsToOne) {
  Counter counter;
  counter.Increment();
  counter.Increment();
  EXPECT_EQ(counter.Value(), 2.0);
}

TEST(CounterTest, IncrementAddsFractionsAndZero) {
  Counter counter;
  counter.Increment(0.25);
  counter.Increment(0.0);
  counter.Increment(1.5);
  EXPECT_EQ(counter.Value(), 1.75);
}

TEST(GaugeTest, StartsAtZero) {
  Gauge gauge;
  EXPECT_EQ(gauge.Value(), 0.0);
}

TEST(GaugeTest, SetOverwrites) {
  Gauge gauge;
  gauge.Set(42.5);
  gauge.Set(-3);
  EXPECT_EQ(gauge.Value(), -3.0);
}

TEST(GaugeTest, IncrementAndDecrement) {
  Gauge gauge;
  gauge.Increment();
  gauge.Increment(4);
  gauge.Decrement();
  gauge.Decrement(0.5);
  EXPECT_EQ(gauge.Value(), 3.5);
}

TEST(GaugeTest, GoesNegative) {
  Gauge gauge;
  gauge.Decrement(2);
  EXPECT_EQ(gauge.Value(), -2.0);
}

TEST(GaugeTest, HoldsNonFiniteValues) {
  Gauge gauge;
  gauge.Set(std::numeric_limits<double>::infinity());
  EXPECT_EQ(gauge.Value(), std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace nq::metrics
