#include "services/streamer/read_pacer.h"

#include <algorithm>
#include <cmath>

namespace nq::streamer {

void ReadPacer::Blend(std::optional<double>& ema, double sample) const {
  if (!std::isfinite(sample) || sample < 0) return;
  ema = ema.has_value() ? (1 - options_.alpha) * *ema + options_.alpha * sample : sample;
}

void ReadPacer::OnReadLanded(double latency_seconds) { Blend(latency_, latency_seconds); }

void ReadPacer::OnTokens(uint64_t tokens, Clock::time_point now) {
  if (tokens == 0) return;
  if (last_tokens_at_.has_value()) {
    const double seconds = std::chrono::duration<double>(now - *last_tokens_at_).count();
    Blend(seconds_per_token_, seconds / static_cast<double>(tokens));
  }
  last_tokens_at_ = now;
}

uint32_t ReadPacer::Budget(uint64_t in_flight) const {
  if (!latency_.has_value() || !seconds_per_token_.has_value() || *latency_ <= 0) return options_.max_budget;
  const double reads_per_second = static_cast<double>(options_.queue_depth) / *latency_;
  const double until_refresh = *seconds_per_token_ * static_cast<double>(options_.refresh_interval);
  const double landable = std::floor(reads_per_second * until_refresh) - static_cast<double>(in_flight);
  const double least = in_flight == 0 ? 1.0 : 0.0;
  return static_cast<uint32_t>(std::clamp(landable, least, static_cast<double>(options_.max_budget)));
}

}  // namespace nq::streamer
