// Encoding and decoding throughput of the tokenizer on 1 MiB of mixed text (bench_text.h),
// per model tokenizer. Compare with bench_reference.mjs (bench/README.md, "Tokenizer").
//
//   tokenizer_bench --benchmark_min_time=2
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>

#include "bench/tokenizer/bench_text.h"
#include "services/tokenizer/stream_detokenizer.h"
#include "services/tokenizer/tokenizer.h"

namespace nq::tokenizer::bench {
namespace {

const std::string& Text() {
  static const std::string* text = new std::string(BenchText(std::string(NQ_TOKENIZER_TEST_DATA) + "/corpus.json"));
  return *text;
}

const Tokenizer& Load(const std::string& name) {
  static auto* cache = new std::map<std::string, std::unique_ptr<Tokenizer>>();
  auto it = cache->find(name);
  if (it != cache->end()) return *it->second;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromFile(std::string(NQ_TOKENIZER_TEST_DATA) + "/" + name + ".tokenizer.json.gz");
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
    std::abort();
  }
  return *cache->emplace(name, *std::move(tokenizer)).first->second;
}

void BM_Encode(benchmark::State& state, const std::string& name) {
  const Tokenizer& tokenizer = Load(name);
  const std::string& text = Text();
  size_t ids = 0;
  for (auto _ : state) {
    absl::StatusOr<std::vector<int32_t>> out = tokenizer.Encode(text, false);
    if (!out.ok()) state.SkipWithError(out.status().ToString().c_str());
    ids = out->size();
    benchmark::DoNotOptimize(out);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["text_bytes"] = static_cast<double>(text.size());
  state.counters["ids"] = static_cast<double>(ids);
}

void BM_Decode(benchmark::State& state, const std::string& name) {
  const Tokenizer& tokenizer = Load(name);
  const std::vector<int32_t> ids = *tokenizer.Encode(Text(), false);
  for (auto _ : state) benchmark::DoNotOptimize(tokenizer.Decode(ids, false));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ids.size()));
}

void BM_StreamDetokenize(benchmark::State& state, const std::string& name) {
  const Tokenizer& tokenizer = Load(name);
  const std::vector<int32_t> ids = *tokenizer.Encode(Text(), false);
  for (auto _ : state) {
    StreamDetokenizer stream(tokenizer);
    for (int32_t id : ids) benchmark::DoNotOptimize(stream.Feed(id));
    benchmark::DoNotOptimize(stream.Flush());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ids.size()));
}

void BM_Load(benchmark::State& state, const std::string& name) {
  const std::string path = std::string(NQ_TOKENIZER_TEST_DATA) + "/" + name + ".tokenizer.json.gz";
  for (auto _ : state) benchmark::DoNotOptimize(Tokenizer::FromFile(path));
}

}  // namespace

#define NQ_TOKENIZER_BENCHMARKS(name)                                          \
  BENCHMARK_CAPTURE(BM_Encode, name, #name)->Unit(benchmark::kMillisecond);  \
  BENCHMARK_CAPTURE(BM_Decode, name, #name)->Unit(benchmark::kMillisecond);  \
  BENCHMARK_CAPTURE(BM_StreamDetokenize, name, #name)->Unit(benchmark::kMillisecond); \
  BENCHMARK_CAPTURE(BM_Load, name, #name)->Unit(benchmark::kMillisecond)->Iterations(3)

NQ_TOKENIZER_BENCHMARKS(deepseek_v3);
NQ_TOKENIZER_BENCHMARKS(qwen3);
NQ_TOKENIZER_BENCHMARKS(llama3);

}  // namespace nq::tokenizer::bench

BENCHMARK_MAIN();
