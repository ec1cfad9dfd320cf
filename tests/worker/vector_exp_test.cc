// ExpInPlace against std::exp: within glibc's 4-ulp bound of the vector library, at every length
// (the four-wide body and the scalar tail), over the range a sampler sees (shifted logits <= 0),
// and the values that must come out exactly: exp(0) = 1, exp(-inf) = 0, underflow to 0.
#include "services/worker/vector_exp.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace nq::worker {
namespace {

TEST(VectorExp, MatchesStdExpWithinFourUlpAtEveryLength) {
  std::printf("ExpInPlace vectorised on this CPU: %s\n", ExpInPlaceIsVectorized() ? "yes (AVX2)" : "no");
  std::mt19937_64 rng(7);
  // Normal results only (exp(-708) is about the smallest normal double): a weight below 1e-307 of
  // the most likely id's is nothing to a draw.
  std::uniform_real_distribution<double> shifted(-708.0, 0.0);
  std::uniform_real_distribution<double> near_max(-30.0, 0.0);
  for (std::size_t n : {0, 1, 3, 4, 5, 8, 13, 1000, 154880}) {
    std::vector<double> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = i % 2 == 0 ? shifted(rng) : near_max(rng);
    const std::vector<double> inputs = values;
    ExpInPlace(values);
    for (std::size_t i = 0; i < n; ++i) {
      const double want = std::exp(inputs[i]);
      const double ulp = std::nextafter(want, 1e300) - want;
      ASSERT_LE(std::abs(values[i] - want), 4 * ulp) << "n " << n << " i " << i << " x " << inputs[i];
    }
  }
}

TEST(VectorExp, ExactWhereTheSamplerNeedsIt) {
  const double inf = std::numeric_limits<double>::infinity();
  // Each value in every lane position of the four-wide body, and in the tail.
  for (std::size_t at = 0; at < 6; ++at) {
    std::vector<double> values(6, -1.0);
    values[at] = -inf;
    ExpInPlace(values);
    EXPECT_EQ(values[at], 0.0) << at;
    std::vector<double> zeros(6, -1.0);
    zeros[at] = 0.0;
    ExpInPlace(zeros);
    EXPECT_EQ(zeros[at], 1.0) << at;
    std::vector<double> deep(6, -1.0);
    deep[at] = -800.0;
    ExpInPlace(deep);
    EXPECT_EQ(deep[at], 0.0) << at;
  }
}

}  // namespace
}  // namespace nq::worker
