#include "services/common/logging.h"

#include <memory>
#include <string>

#include <spdlog/sinks/stdout_sinks.h>

namespace nq {

absl::Status InitLogging(std::string_view service, std::string_view level) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  // from_str maps anything unknown to "off"; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError("--log_level: unknown level '" + std::string(level) +
                                      "' (want trace, debug, info, warn, error or off)");
  }
  auto logger = std::make_shared<spdlog::logger>(
      std::string(service), std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %L %n[%P] %v");
  logger->set_level(parsed);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  return absl::OkStatus();
}

long LogRateLimiter::Allow() {
  const long calls = calls_since_log_.fetch_add(1, std::memory_order_relaxed) + 1;
  const long long now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
  long long next = next_allowed_ns_.load(std::memory_order_relaxed);
  if (now < next) return 0;
  const long long interval =
      std::chrono::duration_cast<std::chrono::nanoseconds>(interval_).count();
  if (!next_allowed_ns_.compare_exchange_strong(next, now + interval)) return 0;
  calls_since_log_.fetch_sub(calls, std::memory_order_relaxed);
  return calls;
}

}  // namespace nq
