#include "services/streamer/read_pacer.h"

#include <chrono>

#include <gtest/gtest.h>

namespace nq::streamer {
namespace {

using Clock = ReadPacer::Clock;
using std::chrono::milliseconds;

ReadPacer Pacer() {
  return ReadPacer(ReadPacerOptions{.queue_depth = 8, .max_budget = 64, .refresh_interval = 16, .alpha = 1.0});
}

TEST(ReadPacerTest, StaticBudgetUntilBothRatesAreMeasured) {
  ReadPacer pacer = Pacer();
  EXPECT_EQ(pacer.Budget(0), 64u);
  pacer.OnReadLanded(0.004);
  EXPECT_EQ(pacer.Budget(0), 64u);  // no decode pace yet
  const Clock::time_point t0 = Clock::now();
  pacer.OnTokens(16, t0);
  EXPECT_EQ(pacer.Budget(0), 64u);  // one report is not a pace
  pacer.OnTokens(16, t0 + milliseconds(160));
  ASSERT_TRUE(pacer.seconds_per_token().has_value());
  EXPECT_NEAR(*pacer.seconds_per_token(), 0.010, 1e-9);
}

TEST(ReadPacerTest, BudgetIsWhatLandsBeforeTheNextRefreshLessReadsInFlight) {
  ReadPacer pacer = Pacer();
  const Clock::time_point t0 = Clock::now();
  pacer.OnTokens(16, t0);
  pacer.OnTokens(16, t0 + milliseconds(160));  // 10 ms a token: 160 ms to the next refresh
  pacer.OnReadLanded(0.040);                   // 8 deep / 40 ms = 200 reads/s: 32 before it
  EXPECT_EQ(pacer.Budget(0), 32u);
  EXPECT_EQ(pacer.Budget(12), 20u);
  EXPECT_EQ(pacer.Budget(40), 0u);  // a backlog already: nothing new
  pacer.OnReadLanded(0.010);        // a faster drive: 128, capped at --read_budget
  EXPECT_EQ(pacer.Budget(0), 64u);
  pacer.OnReadLanded(10.0);         // a stalled drive still gets one load when idle
  EXPECT_EQ(pacer.Budget(0), 1u);
  EXPECT_EQ(pacer.Budget(1), 0u);
}

TEST(ReadPacerTest, ANewSequenceDoesNotCountThePauseBeforeIt) {
  ReadPacer pacer = Pacer();
  const Clock::time_point t0 = Clock::now();
  pacer.OnTokens(16, t0);
  pacer.OnTokens(16, t0 + milliseconds(160));
  pacer.OnNewSequence();
  pacer.OnTokens(16, t0 + milliseconds(60000));
  EXPECT_NEAR(*pacer.seconds_per_token(), 0.010, 1e-9);
}

}  // namespace
}  // namespace nq::streamer
