// Predictor refresh time at 75 MoE layers x 256 experts, top-8, F = 32 (DeepSeek-V3's and
// GLM-5's MoE shape), with 16 observed tokens between refreshes; then a replay of a synthetic
// Zipf trace with drift at the same shape. Prints to stdout (a manual benchmark, not a service).
//
// Usage: predictor_refresh_bench [refreshes=2000] [replay_tokens=8192] [read_budget=256]
//                                [hysteresis_margin=PredictorOptions default]
//                                [scorer=v0|jf] [jf_hidden=16] [jf_queries=2]
// scorer=jf times the learned predictor with deterministic random weights of that size
// (written as a model file and loaded through JfModel::Load, as the streamer does); its replay
// shares mean nothing without training and are not printed.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "services/model/safetensors_writer.h"

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
std::shared_ptr<const JfModel> g_learned;

// A jF model file of GLM-5's shape with small pseudo-random weights (an LCG, like
// scripts/predictor/jf_reference.py's deterministic_params).
absl::StatusOr<std::shared_ptr<const JfModel>> RandomJf(uint32_t hidden, uint32_t queries) {
  uint32_t state = 2026;
  auto values = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) {
      state = 1664525u * state + 1013904223u;
      x = (static_cast<float>(state) / 4294967296.0f - 0.5f) * 0.5f;
    }
    return v;
  };
  const int64_t L = kLayers, E = kExperts, H = hidden, D = kJfFeatures, Q = queries;
  model::SafetensorsWriter writer;
  const std::pair<const char*, std::vector<int64_t>> tensors[] = {
      {"emb", {L, E, H}}, {"w_in", {H, D}},     {"b_in", {H}}, {"query", {Q, H}}, {"w_ctx", {H, Q * H}},
      {"w_h", {H, H}},    {"b_h", {H}},         {"w_out", {H}}, {"b_out", {1}}};
  for (const auto& [name, shape] : tensors) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    if (absl::Status s = writer.AddFloat32(name, shape, values(n)); !s.ok()) return s;
  }
  writer.SetMetadata("format", kJfFormat);
  writer.SetMetadata("version", std::to_string(kJfVersion));
  writer.SetMetadata("feature_set", std::string(kJfFeatureSet));
  writer.SetMetadata("num_layers", std::to_string(kLayers));
  writer.SetMetadata("experts_per_layer", std::to_string(kExperts));
  writer.SetMetadata("top_k", std::to_string(kTopK));
  writer.SetMetadata("features", std::to_string(kJfFeatures));
  writer.SetMetadata("hidden", std::to_string(hidden));
  writer.SetMetadata("queries", std::to_string(queries));
  writer.SetMetadata("horizon", std::to_string(kJfHorizon));
  const std::string path = "/tmp/nq_jf_bench_model.safetensors";
  if (absl::Status s = writer.Write(path); !s.ok()) return s;
  return JfModel::Load(path);
}

PredictorOptions Options(uint32_t read_budget) {
  PredictorOptions options;
  options.learned = g_learned;
  options.top_k = kTopK;
  options.hysteresis_margin = g_margin;
  options.num_layers = kLayers;
  options.experts_per_layer = kExperts;
  options.floating_slots = kFloating;
  options.read_budget = read_budget;
  options.refresh_interval = kBlock;
  return options;
}

// This thread's CPU time: on a shared machine wall time counts the other processes too.
double ThreadCpuMicros() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

int Run(int refreshes, uint64_t replay_tokens, uint32_t read_budget) {
  const uint64_t tokens = static_cast<uint64_t>(refreshes + kWarmupRefreshes) * kBlock;
  const RoutingTrace trace = MakeSyntheticTrace(TraceOptions(tokens));
  absl::StatusOr<Predictor> predictor = Predictor::Create(Options(read_budget));
  if (!predictor.ok()) {
    std::fprintf(stderr, "%s\n", predictor.status().ToString().c_str());
    return 1;
  }
  using Clock = std::chrono::steady_clock;
  std::vector<double> refresh_us;
  std::vector<double> refresh_cpu_us;
  double observe_ns = 0;
  double observe_cpu_us = 0;
  uint64_t loads = 0;
  size_t token = 0;
  for (int r = 0; r < refreshes + kWarmupRefreshes; ++r) {
    const auto observe_start = Clock::now();
    const double observe_cpu_start = ThreadCpuMicros();
    for (uint32_t t = 0; t < kBlock; ++t, ++token) {
      if (!predictor->Observe(trace.TokenExperts(token), trace.TokenWeights(token)).ok()) return 1;
    }
    const auto refresh_start = Clock::now();
    const double refresh_cpu_start = ThreadCpuMicros();
    const PredictorPlan& plan = predictor->Refresh();
    const double refresh_cpu_end = ThreadCpuMicros();
    const auto refresh_end = Clock::now();
    if (r >= kWarmupRefreshes) {
      refresh_us.push_back(
          std::chrono::duration<double, std::micro>(refresh_end - refresh_start).count());
      observe_ns += std::chrono::duration<double, std::nano>(refresh_start - observe_start).count();
      refresh_cpu_us.push_back(refresh_cpu_end - refresh_cpu_start);
      observe_cpu_us += refresh_cpu_start - observe_cpu_start;
      loads += plan.loads.size();
    }
  }
  std::sort(refresh_us.begin(), refresh_us.end());
  double mean = 0;
  for (double us : refresh_us) mean += us;
  mean /= static_cast<double>(refresh_us.size());
  const double p50 = refresh_us[refresh_us.size() / 2];
  const double p99 = refresh_us[std::min(refresh_us.size() - 1, refresh_us.size() * 99 / 100)];
  std::printf("refresh (%s): %u layers x %u experts, top-%u, F=%u, budget %u, margin %.2f, %d refreshes "
              "(after %d warm-up)\n",
              g_learned ? "jF" : "v0", kLayers, kExperts, kTopK, kFloating, read_budget, g_margin, refreshes,
              kWarmupRefreshes);
  if (g_learned) {
    std::printf("  jF hidden %u, %u pooling queries\n", g_learned->geometry().hidden, g_learned->geometry().queries);
  }
  std::printf("  refresh wall time: mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us\n", mean, p50, p99,
              refresh_us.back());
  std::sort(refresh_cpu_us.begin(), refresh_cpu_us.end());
  double cpu_mean = 0;
  for (double us : refresh_cpu_us) cpu_mean += us;
  cpu_mean /= static_cast<double>(refresh_cpu_us.size());
  std::printf("  refresh thread CPU time: mean %.1f us, p50 %.1f us, p99 %.1f us; observe %.2f us CPU per token\n",
              cpu_mean, refresh_cpu_us[refresh_cpu_us.size() / 2],
              refresh_cpu_us[std::min(refresh_cpu_us.size() - 1, refresh_cpu_us.size() * 99 / 100)],
              observe_cpu_us / (static_cast<double>(refreshes) * kBlock));
  std::printf("  observe mean %.2f us per token; %.1f loads per refresh\n",
              observe_ns / 1000.0 / (static_cast<double>(refreshes) * kBlock),
              static_cast<double>(loads) / refreshes);

  if (g_learned) return 0;  // untrained weights: replay shares would mean nothing
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
  if (argc > 5 && std::string(argv[5]) == "jf") {
    const uint32_t hidden = argc > 6 ? static_cast<uint32_t>(std::atoi(argv[6])) : 16;
    const uint32_t queries = argc > 7 ? static_cast<uint32_t>(std::atoi(argv[7])) : 2;
    absl::StatusOr<std::shared_ptr<const nq::streamer::JfModel>> model = nq::streamer::RandomJf(hidden, queries);
    if (!model.ok()) {
      std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
      return 1;
    }
    nq::streamer::g_learned = *model;
  } else if (argc > 5 && std::string(argv[5]) != "v0") {
    std::fprintf(stderr, "scorer must be v0 or jf\n");
    return 2;
  }
  return nq::streamer::Run(refreshes, replay_tokens, budget);
}
