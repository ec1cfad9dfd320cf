// Updates from many threads must not lose increments; registration must hand every thread the
// same family and child.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/common/metrics/registry.h"

namespace nq::metrics {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::Eq;

constexpr int kThreads = 8;
constexpr int kIterations = 200000;

// Runs `body(thread_index)` on kThreads threads, released together to maximise contention.
template <typename Body>
void RunConcurrently(Body body) {
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load(std::memory_order_acquire)) {
      }
      body(t);
    });
  }
  go.store(true, std::memory_order_release);
  for (std::thread& thread : threads) thread.join();
}

TEST(ConcurrencyTest, CounterIncrementsAreExact) {
  Registry registry;
  Counter& counter = registry.Counter("nq_x_total", "X.").Get();
  RunConcurrently([&](int) {
    for (int i = 0; i < kIterations; ++i) counter.Increment();
  });
  EXPECT_EQ(counter.Value(), static_cast<double>(kThreads) * kIterations);
}

TEST(ConcurrencyTest, GaugeIncrementsAndDecrementsCancel) {
  Registry registry;
  Gauge& gauge = registry.Gauge("nq_g", "G.").Get();
  RunConcurrently([&](int t) {
    for (int i = 0; i < kIterations; ++i) {
      if (t % 2 == 0) {
        gauge.Increment(2);
      } else {
        gauge.Decrement();
      }
    }
  });
  EXPECT_EQ(gauge.Value(), static_cast<double>(kThreads / 2) * kIterations);
}

TEST(ConcurrencyTest, HistogramObservationsAreExact) {
  Registry registry;
  Histogram& histogram = registry.Histogram("nq_h_seconds", "H.", {1, 2}).Get();
  // Multiples of 0.5 keep every partial sum exact, so the total is order-independent.
  RunConcurrently([&](int) {
    for (int i = 0; i < kIterations; ++i) histogram.Observe(0.5 * (i % 6));
  });
  const HistogramSnapshot snapshot = histogram.Snapshot();
  const uint64_t total = static_cast<uint64_t>(kThreads) * kIterations;
  EXPECT_EQ(snapshot.count, total);
  // Per thread, i % 6 in {0,1,2} is <= 1, {3,4} is <= 2, {5} above; kIterations % 6 == 2.
  const uint64_t per_round = kIterations / 6;
  EXPECT_THAT(snapshot.cumulative_counts,
              ElementsAre(kThreads * (3 * per_round + 2), kThreads * (5 * per_round + 2), total));
  EXPECT_EQ(snapshot.sum, kThreads * (per_round * 7.5 + 0.5));
}

TEST(ConcurrencyTest, ConcurrentRegistrationAndLabelLookupAgree) {
  Registry registry;
  std::vector<CounterFamily*> families(kThreads);
  std::vector<Counter*> children(kThreads);
  RunConcurrently([&](int t) {
    families[t] = &registry.Counter("nq_x_total", "X.", {"model"});
    children[t] = &families[t]->WithLabels({"shared"});
    for (int i = 0; i < 1000; ++i) {
      families[t]->WithLabels({std::to_string(i % 50)}).Increment();
      children[t]->Increment();
    }
  });
  EXPECT_THAT(families, Each(Eq(families[0])));
  EXPECT_THAT(children, Each(Eq(children[0])));
  EXPECT_EQ(children[0]->Value(), kThreads * 1000.0);
  EXPECT_EQ(families[0]->WithLabels({"7"}).Value(), kThreads * 1000.0 / 50);
}

// Every scrape taken while writers run must be internally consistent: a histogram's `+Inf`
// bucket equals its `_count`.
TEST(ConcurrencyTest, SerializeWhileUpdating) {
  Registry registry;
  HistogramFamily& family = registry.Histogram("nq_h_seconds", "H.", {1}, {"worker"});
  std::atomic<bool> done{false};
  std::thread scraper([&] {
    while (!done.load()) {
      uint64_t inf_bucket = 0;
      // absl::string_view: Debian's Abseil does not alias it to std::string_view.
      for (absl::string_view line : absl::StrSplit(registry.Serialize(), '\n')) {
        std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
        if (fields.size() != 2) continue;
        uint64_t value = 0;
        if (absl::StrContains(fields[0], "le=\"+Inf\"")) {
          ASSERT_TRUE(absl::SimpleAtoi(fields[1], &inf_bucket));
        } else if (absl::StartsWith(fields[0], "nq_h_seconds_count")) {
          ASSERT_TRUE(absl::SimpleAtoi(fields[1], &value));
          EXPECT_EQ(value, inf_bucket) << line;
        }
      }
    }
  });
  RunConcurrently([&](int t) {
    Histogram& histogram = family.WithLabels({std::to_string(t)});
    for (int i = 0; i < kIterations / 10; ++i) histogram.Observe(i % 3);
  });
  done.store(true);
  scraper.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(family.WithLabels({std::to_string(t)}).Snapshot().count,
              static_cast<uint64_t>(kIterations / 10));
  }
}

}  // namespace
}  // namespace nq::metrics
