// What the leader worker's host-side sampling costs per token, at the vocabularies of GLM-5
// (154880) and DeepSeek-V3 (129280): greedy with and without the log-probabilities (the softmax
// over the vocabulary they need), and temperature (with and without them) / nucleus draws; then
// the same draws through the device sampler's host twin (kernels::SampleRowHost). Rows of
// N(0, 3) logits.
//
//   sampler_bench [--benchmark_filter=Greedy]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/sample_tokens.h"
#include "services/worker/sampler.h"

namespace nq::worker {
namespace {

std::vector<float> Logits(int64_t vocab) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> row(static_cast<size_t>(vocab));
  for (float& l : row) l = normal(rng);
  return row;
}

void Run(benchmark::State& state, SamplingConfig config) {
  const std::vector<float> row = Logits(state.range(0));
  absl::StatusOr<Sampler> sampler = Sampler::Create(config);
  if (!sampler.ok()) {
    state.SkipWithError(sampler.status().ToString().c_str());
    return;
  }
  for (auto _ : state) {
    absl::StatusOr<SampledToken> token = sampler->Sample(row);
    benchmark::DoNotOptimize(token);
  }
}

void BM_GreedyWithoutLogprobs(benchmark::State& state) {
  SamplingConfig c{.temperature = 0};
  c.logprobs = false;
  Run(state, c);
}
void BM_GreedyWithLogprobs(benchmark::State& state) { Run(state, {.temperature = 0}); }
void BM_Temperature(benchmark::State& state) { Run(state, {.temperature = 0.8f, .seed = 3}); }
void BM_TemperatureWithoutLogprobs(benchmark::State& state) {
  SamplingConfig c{.temperature = 0.8f, .seed = 3};
  c.logprobs = false;
  Run(state, c);
}
void BM_TopP(benchmark::State& state) { Run(state, {.temperature = 0.8f, .top_p = 0.95f, .seed = 3}); }
void BM_TopPWithoutLogprobs(benchmark::State& state) {
  SamplingConfig c{.temperature = 0.8f, .top_p = 0.95f, .seed = 3};
  c.logprobs = false;
  Run(state, c);
}

// The same draws through kernels::SampleRowHost, the host twin of the device sampler (integer
// weights, radix selection), as Sampler::DeviceDraw hands them over.
void RunTwin(benchmark::State& state, kernels::SampleParams params) {
  const std::vector<float> row = Logits(state.range(0));
  std::mt19937_64 rng(3);
  for (auto _ : state) {
    params.u01 = std::generate_canonical<double, 53>(rng);
    benchmark::DoNotOptimize(kernels::SampleRowHost(row, params));
  }
}
void BM_TwinTemperature(benchmark::State& state) { RunTwin(state, {.temperature = 0.8f}); }
void BM_TwinTopP(benchmark::State& state) { RunTwin(state, {.temperature = 0.8f, .top_p = 0.95f}); }
void BM_TwinTopK(benchmark::State& state) { RunTwin(state, {.temperature = 0.8f, .top_k = 50}); }

BENCHMARK(BM_GreedyWithoutLogprobs)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GreedyWithLogprobs)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Temperature)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TemperatureWithoutLogprobs)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopP)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopPWithoutLogprobs)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TwinTemperature)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TwinTopP)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TwinTopK)->Arg(129280)->Arg(154880)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace nq::worker

BENCHMARK_MAIN();
