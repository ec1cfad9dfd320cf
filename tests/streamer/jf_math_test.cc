// jf_math.h's branch-free exp and softplus against libm (in double) over their whole range,
// at the bounds the header states.
#include <cmath>
#include <cstdint>

#include <gtest/gtest.h>

#include "services/streamer/jf_math.h"

namespace nq::streamer {
namespace {

TEST(JfMathTest, ExpClampedIsWithinItsBound) {
  double worst = 0;
  for (float x = kJfExpMin; x <= 0.0f; x += 0.00131f) {
    const double want = std::exp(static_cast<double>(x));
    const double rel = std::fabs(ExpClamped(x) - want) / want;
    worst = std::max(worst, rel);
    ASSERT_LT(rel, 3e-7) << "x = " << x;
  }
  EXPECT_GT(worst, 0.0);  // the loop ran and compared
  EXPECT_EQ(ExpClamped(0.0f), 1.0f);
  // Below the smallest normal: clamped, never 0 or a denormal.
  EXPECT_EQ(ExpClamped(-1000.0f), ExpClamped(kJfExpMin));
  EXPECT_TRUE(std::isnormal(ExpClamped(-1000.0f)));
}

TEST(JfMathTest, SoftplusIsWithinItsBound) {
  for (float x = -85.0f; x <= 85.0f; x += 0.00517f) {
    const double xd = x;
    const double want = xd > 0 ? xd + std::log1p(std::exp(-xd)) : std::log1p(std::exp(xd));
    ASSERT_LT(std::fabs(Softplus(x) - want) / want, 1e-6) << "x = " << x;
  }
  EXPECT_EQ(Softplus(1e30f), 1e30f);
  EXPECT_EQ(Softplus(100.0f), 100.0f);
  EXPECT_GT(Softplus(-80.0f), 0.0f);  // e^-80, not a rounded 0
}

}  // namespace
}  // namespace nq::streamer
