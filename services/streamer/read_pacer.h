// Disk-aware load budget (issue #21, DESIGN.md section 7: "budget issues by measured
// throughput so no backlog builds"). A load is worth its expected hits between the time it
// lands and the predictor's horizon; a load that cannot land before the next refresh replans
// it only adds to a backlog the next plan will partly cancel. So each refresh may issue what
// the drive, as measured, lands before the next refresh, less the reads still in flight:
//
//   reads per second   = queue_depth / issue-to-landing latency   (Little's law at full depth)
//   seconds to refresh = seconds per decode token x refresh_interval (from the reports' pace)
//   budget             = floor(reads per second x seconds to refresh) - reads in flight,
//                        clamped to [0, max_budget]; 1 when nothing is in flight (an idle drive
//                        always gets the best load).
// Both rates are EMAs; until each has a sample the budget is max_budget (the static
// --read_budget). Not thread-safe (the loader thread owns it).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

namespace nq::streamer {

struct ReadPacerOptions {
  uint32_t queue_depth = 8;      // reads in flight at once (RecordStoreOptions::queue_depth)
  uint32_t max_budget = 64;      // --read_budget
  uint32_t refresh_interval = 16;  // tokens between refreshes
  // Weight of a new sample in the EMAs: about the last 1 / alpha samples count.
  double alpha = 0.1;
};

class ReadPacer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit ReadPacer(ReadPacerOptions options) : options_(options) {}

  // A read landed `latency_seconds` after it was issued.
  void OnReadLanded(double latency_seconds);
  // `tokens` decode tokens were reported, the last of them at `now`.
  void OnTokens(uint64_t tokens, Clock::time_point now);
  // A new sequence: the pause before it is not decode pace.
  void OnNewSequence() { last_tokens_at_.reset(); }

  // New loads the refresh due now may issue with `in_flight` reads outstanding.
  uint32_t Budget(uint64_t in_flight) const;

  std::optional<double> latency_seconds() const { return latency_; }
  std::optional<double> seconds_per_token() const { return seconds_per_token_; }

 private:
  void Blend(std::optional<double>& ema, double sample) const;

  ReadPacerOptions options_;
  std::optional<double> latency_;
  std::optional<double> seconds_per_token_;
  std::optional<Clock::time_point> last_tokens_at_;
};

}  // namespace nq::streamer
