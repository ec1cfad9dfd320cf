// Polls `condition` every 2 ms until it holds or `timeout` passes (tests of threads and processes
// that finish on their own time); the last answer is returned.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace nq::testing {

inline bool WaitUntil(const std::function<bool()>& condition,
                      std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return condition();
}

}  // namespace nq::testing
