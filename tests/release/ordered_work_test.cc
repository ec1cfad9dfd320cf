// OrderedWork: items done by several threads come back in order, each exactly once, whatever
// order they finish in; an error is returned at its turn and stops the hand-out; the bound on
// items ahead of the taker holds.
#include "services/release/ordered_work.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace nq::release {
namespace {

TEST(OrderedWork, ItemsComeBackInOrderWhateverOrderTheyFinishIn) {
  for (int workers : {1, 2, 5}) {
    SCOPED_TRACE(workers);
    std::atomic<int> calls{0};
    OrderedWork<int64_t> work(40, workers, 2 * workers, [&](int64_t i, int w) -> absl::StatusOr<int64_t> {
      EXPECT_GE(w, 0);
      EXPECT_LT(w, workers);
      ++calls;
      // Early items finish last.
      std::this_thread::sleep_for(std::chrono::microseconds(200 * ((40 - i) % 7)));
      return i * i;
    });
    for (int64_t i = 0; i < 40; ++i) {
      absl::StatusOr<int64_t> r = work.Take(i);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(*r, i * i);
    }
    EXPECT_EQ(calls.load(), 40);
  }
}

TEST(OrderedWork, NoItemRunsMoreThanAheadPastTheOneTaken) {
  std::atomic<int64_t> highest{-1};
  OrderedWork<int64_t> work(30, 4, 3, [&](int64_t i, int) -> absl::StatusOr<int64_t> {
    int64_t h = highest.load();
    while (i > h && !highest.compare_exchange_weak(h, i)) {
    }
    return i;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the workers run as far as they may
  EXPECT_LE(highest.load(), 2);  // items 0, 1, 2 before anything is taken
  for (int64_t i = 0; i < 30; ++i) {
    ASSERT_TRUE(work.Take(i).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_LE(highest.load(), i + 3);
  }
}

TEST(OrderedWork, AnErrorComesBackAtItsTurnAndStopsTheHandOut) {
  std::atomic<int64_t> started{0};
  OrderedWork<int> work(1000, 3, 6, [&](int64_t i, int) -> absl::StatusOr<int> {
    ++started;
    if (i == 4) return absl::DataLossError("expert 4 is damaged");
    return static_cast<int>(i);
  });
  for (int64_t i = 0; i < 4; ++i) ASSERT_TRUE(work.Take(i).ok());
  absl::StatusOr<int> failed = work.Take(4);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(failed.status().message(), "expert 4 is damaged");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_LE(started.load(), 4 + 6 + 3);  // what was already handed out, nothing more
}

TEST(OrderedWork, DestroyingItEarlyWaitsForTheItemsUnderWay) {
  std::atomic<int> running{0};
  {
    OrderedWork<int> work(100, 4, 8, [&](int64_t, int) -> absl::StatusOr<int> {
      ++running;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      --running;
      return 0;
    });
    ASSERT_TRUE(work.Take(0).ok());
  }
  EXPECT_EQ(running.load(), 0);
}

}  // namespace
}  // namespace nq::release
