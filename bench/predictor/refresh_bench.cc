// PredictorV0 refresh time at 75 MoE layers x 256 experts, top-8, F = 32 (DeepSeek-V3's MoE
// shape), with 16 observed tokens between refreshes; then a replay of a synthetic Zipf trace
// with drift at the same shape. Prints to stdout (a manual benchmark, not a service).
//
// Usage: predictor_refresh_bench [refreshes=2000] [replay_tokens=8192] [read_budget=256]
//                                [hysteresis_margin=PredictorOptions default]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "services/streamer/predictor.h"
#include "services/streamer/replay.h"
#include "services/streamer/routing_trace_synthetic.h"

namespace nq::streamer {
namespace {

constexpr uint32_t kLayers = 75;
constexpr uint32_t kExperts = 256;
constexpr uint32_t kTopK = 8;
constexpr uint32_t kFloating = 32;
constexpr uint32_t kBlock = 16;
constexpr int kWarmupRefreshes = 50;

SyntheticTraceOptions TraceOptions(uint64_t tokens) {
  SyntheticTraceOptions options;
  options.num_layers = kLayers;
  options.experts_per_layer = kExperts;
  options.top_k = kTopK;
  options.num_tokens = tokens;
  options.zipf_exponent = 0.8;
  options.drift_interval = 64;
  options.drift_swaps = 8;
  options.drift_distance = 32;
  options.seed = 42;
  return options;
}

float g_margin = PredictorOptions().hysteresis_margin;

PredictorOptions Options(uint32_t read_budget) {
  PredictorOptions options;
  options.hysteresis_margin = g_margin;
  options.num_layers = kLayers;
  options.experts_per_layer = kExperts;
  options.floating_slots = kFloating;
  options.read_budget = read_budget;
  options.refresh_interval = kBlock;
  return options;
}

int Run(int refreshes, uint64_t replay_tokens, uint32_t read_budget) {
  const uint64_t tokens = static_cast<uint64_t>(refreshes + kWarmupRefreshes) * kBlock;
  const RoutingTrace trace = MakeSyntheticTrace(TraceOptions(tokens));
  absl::StatusOr<PredictorV0> predictor = PredictorV0::Create(Options(read_budget));
  if (!predictor.ok()) {
    std::fprintf(stderr, "%s\n", predictor.status().ToString().c_str());
    return 1;
  }
  using Clock = std::chrono::steady_clock;
  std::vector<double> refresh_us;
  double observe_ns = 0;
  uint64_t loads = 0;
  size_t token = 0;
  for (int r = 0; r < refreshes + kWarmupRefreshes; ++r) {
    const auto observe_start = Clock::now();
    for (uint32_t t = 0; t < kBlock; ++t, ++token) {
      if (!predictor->Observe(trace.TokenExperts(token), trace.TokenWeights(token)).ok()) return 1;
    }
    const auto refresh_start = Clock::now();
    const PredictorPlan& plan = predictor->Refresh();
    const auto refresh_end = Clock::now();
    if (r >= kWarmupRefreshes) {
      refresh_us.push_back(
          std::chrono::duration<double, std::micro>(refresh_end - refresh_start).count());
      observe_ns += std::chrono::duration<double, std::nano>(refresh_start - observe_start).count();
      loads += plan.loads.size();
    }
  }
  std::sort(refresh_us.begin(), refresh_us.end());
  double mean = 0;
  for (double us : refresh_us) mean += us;
  mean /= static_cast<double>(refresh_us.size());
  const double p50 = refresh_us[refresh_us.size() / 2];
  const double p99 = refresh_us[std::min(refresh_us.size() - 1, refresh_us.size() * 99 / 100)];
  std::printf("refresh: %u layers x %u experts, top-%u, F=%u, budget %u, margin %.2f, %d refreshes "
              "(after %d warm-up)\n",
              kLayers, kExperts, kTopK, kFloating, read_budget, g_margin, refreshes,
              kWarmupRefreshes);
  std::printf("  refresh mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us\n", mean, p50, p99,
              refresh_us.back());
  std::printf("  observe mean %.2f us per token; %.1f loads per refresh\n",
              observe_ns / 1000.0 / (static_cast<double>(refreshes) * kBlock),
              static_cast<double>(loads) / refreshes);

  const RoutingTrace replay_trace = MakeSyntheticTrace(TraceOptions(replay_tokens));
  absl::StatusOr<ReplayResult> result = Replay(replay_trace, Options(read_budget));
  if (!result.ok()) {
    std::fprintf(stderr, "%s\n", result.status().ToString().c_str());
    return 1;
  }
  std::printf("replay: %llu tokens (Zipf 0.8, drift 8 swaps/64 tokens), share at 4 bits "
              "(calls / weight):\n",
              static_cast<unsigned long long>(result->tokens));
  std::printf("  oracle          %.4f / %.4f\n", result->oracle.calls, result->oracle.weight);
  std::printf("  previous block  %.4f / %.4f\n", result->previous_block.calls,
              result->previous_block.weight);
  std::printf("  predictor v0    %.4f / %.4f  (%.1f loads per refresh, %.1f wanted)\n",
              result->predictor.calls, result->predictor.weight,
              static_cast<double>(result->predictor_loads) / result->blocks,
              static_cast<double>(result->predictor_wanted) / result->blocks);
  return 0;
}

}  // namespace
}  // namespace nq::streamer

int main(int argc, char** argv) {
  const int refreshes = argc > 1 ? std::atoi(argv[1]) : 2000;
  const uint64_t replay_tokens = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 8192;
  const uint32_t budget = argc > 3 ? static_cast<uint32_t>(std::atoi(argv[3])) : 256;
  if (argc > 4) nq::streamer::g_margin = std::strtof(argv[4], nullptr);
  if (refreshes <= 0) return 2;
  return nq::streamer::Run(refreshes, replay_tokens, budget);
}
