// Logging through spdlog (Debian's libspdlog-dev), to stderr, one logger per service.
#pragma once

#include <atomic>
#include <chrono>
#include <string_view>

#include <spdlog/spdlog.h>

#include "absl/status/status.h"

namespace nq {

// Installs the default logger named after the service ("router", "worker", ...) at `level`
// ("trace", "debug", "info", "warn", "error", "off"). InvalidArgument for an unknown level.
absl::Status InitLogging(std::string_view service, std::string_view level);

// Lets a hot-path message through at most once per interval, counting what it suppressed:
//   static LogRateLimiter limiter(std::chrono::seconds(5));
//   if (auto n = limiter.Allow()) spdlog::warn("... ({} similar suppressed)", *n - 1);
class LogRateLimiter {
 public:
  explicit LogRateLimiter(std::chrono::steady_clock::duration interval) : interval_(interval) {}
  // Returns the number of calls since the last allowed one (>= 1) when this call may log,
  // 0 when it should stay quiet.
  long Allow();

 private:
  const std::chrono::steady_clock::duration interval_;
  std::atomic<long long> next_allowed_ns_{0};
  std::atomic<long> calls_since_log_{0};
};

}  // namespace nq
