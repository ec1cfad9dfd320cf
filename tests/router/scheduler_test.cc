#include "services/router/scheduler.h"

#include <atomic>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "tests/common/status_matchers.h"

namespace nq::router {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr auto kForever = std::chrono::steady_clock::time_point::max();
auto NotCancelled() { return [] { return false; }; }

TEST(SchedulerTest, RunsOneAtATimeInArrivalOrder) {
  metrics::Registry metrics;
  Scheduler scheduler(8, metrics);
  absl::StatusOr<Scheduler::Slot> first = scheduler.Admit(NotCancelled(), kForever);
  ASSERT_THAT(first, IsOk());
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 5; ++i) {
    waiters.emplace_back([&, i] {
      absl::StatusOr<Scheduler::Slot> slot = scheduler.Admit(NotCancelled(), kForever);
      ASSERT_THAT(slot, IsOk());
      absl::MutexLock lock(&mu);
      order.push_back(i);
    });
    // Each waiter is queued before the next arrives.
    while (scheduler.waiting() != static_cast<size_t>(i + 1)) std::this_thread::yield();
  }
  EXPECT_TRUE(scheduler.running());
  { Scheduler::Slot release = *std::move(first); }
  for (std::thread& t : waiters) t.join();
  EXPECT_THAT(order, ElementsAre(0, 1, 2, 3, 4));
  EXPECT_FALSE(scheduler.running());
  EXPECT_THAT(metrics.Serialize(), HasSubstr("nq_num_requests_waiting 0"));
}

TEST(SchedulerTest, RefusesPastTheQueueBound) {
  metrics::Registry metrics;
  Scheduler scheduler(1, metrics);
  absl::StatusOr<Scheduler::Slot> running = scheduler.Admit(NotCancelled(), kForever);
  ASSERT_THAT(running, IsOk());
  std::thread waiter([&] { EXPECT_THAT(scheduler.Admit(NotCancelled(), kForever), IsOk()); });
  while (scheduler.waiting() != 1) std::this_thread::yield();
  EXPECT_THAT(scheduler.Admit(NotCancelled(), kForever),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("1 requests are already waiting")));
  EXPECT_THAT(metrics.Serialize(), HasSubstr("nq_requests_rejected_total 1"));
  { Scheduler::Slot release = *std::move(running); }
  waiter.join();
}

TEST(SchedulerTest, CancelledAndExpiredWaitersLeaveTheQueue) {
  metrics::Registry metrics;
  Scheduler scheduler(4, metrics);
  absl::StatusOr<Scheduler::Slot> running = scheduler.Admit(NotCancelled(), kForever);
  ASSERT_THAT(running, IsOk());
  std::atomic<bool> cancel{false};
  std::thread cancelled([&] {
    EXPECT_THAT(scheduler.Admit([&] { return cancel.load(); }, kForever),
                StatusIs(absl::StatusCode::kCancelled, HasSubstr("went away")));
  });
  while (scheduler.waiting() != 1) std::this_thread::yield();
  cancel = true;
  cancelled.join();
  EXPECT_EQ(scheduler.waiting(), 0u);
  EXPECT_THAT(scheduler.Admit(NotCancelled(), std::chrono::steady_clock::now() + std::chrono::milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("deadline")));
  EXPECT_EQ(scheduler.waiting(), 0u);
}

}  // namespace
}  // namespace nq::router
