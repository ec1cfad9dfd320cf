// Work items done by several threads and taken in order: nq encode's experts, encoded by a pool
// of workers (each with its own tile search) and written one after another in expert order, so
// the release's files do not depend on how many workers there were or which finished first.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::release {

template <typename T>
class OrderedWork {
 public:
  using Work = std::function<absl::StatusOr<T>(int64_t item, int worker)>;

  // Runs work(i, w) for i = 0 .. n - 1, handed out in order to workers w = 0 .. workers - 1, at
  // most `ahead` items past the last one taken (a bound on the results held). One worker runs
  // each item inside Take, on the caller's thread.
  OrderedWork(int64_t n, int workers, int ahead, Work work)
      : n_(n), ahead_(std::max(1, ahead)), work_(std::move(work)), results_(static_cast<size_t>(n)) {
    if (workers <= 1) return;
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this, w] { Run(w); });
  }

  OrderedWork(const OrderedWork&) = delete;
  OrderedWork& operator=(const OrderedWork&) = delete;

  // Stops handing out items and waits for the ones under way.
  ~OrderedWork() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    changed_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // Item i's result; call with i = 0, 1, 2, ... After an error the caller should stop (items
  // past it may still be done, and are dropped with this object).
  absl::StatusOr<T> Take(int64_t i) {
    if (threads_.empty()) return work_(i, 0);
    std::unique_lock<std::mutex> lock(mu_);
    taken_ = i;
    changed_.notify_all();
    changed_.wait(lock, [&] { return results_[static_cast<size_t>(i)].has_value(); });
    absl::StatusOr<T> result = *std::move(results_[static_cast<size_t>(i)]);
    results_[static_cast<size_t>(i)].reset();
    if (!result.ok()) stopped_ = true;
    return result;
  }

 private:
  void Run(int worker) {
    while (true) {
      int64_t item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        changed_.wait(lock, [&] { return stopped_ || next_ >= n_ || next_ < taken_ + ahead_; });
        if (stopped_ || next_ >= n_) return;
        item = next_++;
      }
      absl::StatusOr<T> result = work_(item, worker);
      {
        std::lock_guard<std::mutex> lock(mu_);
        results_[static_cast<size_t>(item)] = std::move(result);
      }
      changed_.notify_all();
    }
  }

  const int64_t n_;
  const int ahead_;
  const Work work_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::optional<absl::StatusOr<T>>> results_;  // guarded by mu_
  int64_t next_ = 0;                                       // guarded by mu_
  int64_t taken_ = 0;                                      // guarded by mu_
  bool stopped_ = false;                                   // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace nq::release
