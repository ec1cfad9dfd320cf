// indexer_bench: the DSA indexer's decode selection on the GPU (issue #13; results and how to rerun
// them: bench/README.md). A measurement, not a test: one line per case with microseconds per call
// (scores, selection and the scratch memset, as a decode step runs them; each case through both
// decode selections, IndexerDecodeSelect) and the bytes the call
// must read (the visible indexer keys and the queries, F32) over the device-to-device copy
// bandwidth measured in the same run.
//
// Each case runs on enough independent copies of its keys that nothing stays in the 50 MB L2
// between calls (consecutive layers): a CUDA graph runs every copy once, replayed.
//
//   indexer_bench [--quick] [--only NAME]   (--quick: the first selected case only, for a
//     profiler; --only: the cases whose "name keys" holds NAME, e.g. "glm5" or "glm5 decode 131072")
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/indexer_topk.cuh"
#include "tests/kernels/cuda/bench_util.h"

namespace nq::kernels::cuda {
namespace {

using ::nq::bench::GraphReplayMicros;

constexpr std::size_t kColdBytes = std::size_t{400} << 20;  // 8x the L2

float* DeviceNormal(std::size_t count, std::uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> host(count);
  for (float& v : host) v = normal(rng);
  float* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, count * sizeof(float)));
  BENCH_CHECK(cudaMemcpy(p, host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

struct Case {
  const char* name;
  int tokens, heads, keys, top_k;
  int dim = 128;
};

struct Instance {
  IndexerTopKParams p;
  std::vector<void*> owned;
};

void RunCase(const Case& c, IndexerDecodeSelect path, double copy_bw, int num_sms, cudaStream_t stream) {
  const std::size_t key_bytes = std::size_t{4} * c.keys * c.dim;
  const int n = static_cast<int>(std::clamp<std::size_t>(kColdBytes / key_bytes + 1, 2, 64));
  std::vector<Instance> copies(n);
  for (int i = 0; i < n; ++i) {
    Instance& in = copies[i];
    IndexerTopKParams& p = in.p;
    auto keep = [&](void* ptr) {
      in.owned.push_back(ptr);
      return ptr;
    };
    p.q = static_cast<float*>(keep(DeviceNormal(std::size_t{1} * c.tokens * c.heads * c.dim, 7 * i + 1, 1.0f)));
    p.k = static_cast<float*>(keep(DeviceNormal(std::size_t{1} * c.keys * c.dim, 7 * i + 2, 1.0f)));
    p.weights = static_cast<float*>(keep(DeviceNormal(std::size_t{1} * c.tokens * c.heads, 7 * i + 3, 0.1f)));
    void* selected = nullptr;
    BENCH_CHECK(cudaMalloc(&selected, std::size_t{4} * c.tokens * c.top_k));
    p.selected = static_cast<std::int32_t*>(keep(selected));
    void* scores = nullptr;
    BENCH_CHECK(cudaMalloc(&scores, std::size_t{4} * c.tokens * c.keys));
    p.scores = static_cast<float*>(keep(scores));
    void* select_scratch = nullptr;
    BENCH_CHECK(cudaMalloc(&select_scratch, static_cast<std::size_t>(IndexerSelectScratchBytes(c.tokens, c.keys, c.top_k))));
    p.select_scratch = keep(select_scratch);
    p.tokens = c.tokens;
    p.heads = c.heads;
    p.dim = c.dim;
    p.top_k = c.top_k;
    p.start_pos = c.keys - c.tokens;
    p.score_rows = c.tokens;
    p.decode_select = path;
  }
  auto launch = [&]() {
    for (const Instance& in : copies) BENCH_OK(LaunchIndexerTopK(in.p, {.stream = stream, .num_sms = num_sms}));
  };
  launch();  // outside the graph: the launcher sets the kernels' shared-memory attributes
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const double us = GraphReplayMicros(stream, 20, launch) / static_cast<double>(copies.size());
  const double bytes = static_cast<double>(key_bytes) + 4.0 * c.tokens * c.heads * c.dim;
  std::printf("%-28s %-9s T=%d H=%-3d keys=%-7d top_k=%-5d %9.2f us  %7.2f MB  %6.2f TB/s  ratio to copy %.3f\n",
              c.name, path == IndexerDecodeSelect::kOneBlock ? "one-block" : "filtered", c.tokens, c.heads, c.keys,
              c.top_k, us, bytes / 1e6, bytes / (us * 1e-6) / 1e12,
              bytes / (us * 1e-6) / copy_bw);
  std::fflush(stdout);
  for (Instance& in : copies) {
    for (void* p : in.owned) BENCH_CHECK(cudaFree(p));
  }
}

}  // namespace
}  // namespace nq::kernels::cuda

int main(int argc, char** argv) {
  using namespace nq::kernels::cuda;
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
  }
  const nq::bench::BenchDevice d = nq::bench::OpenBenchDevice();
  // GLM-5's indexer (32 heads of 128, top 2048) at the decode slice's context, below top_k, and at
  // the issue's key counts; the 64-head rows are CudaTiming's shape (bench/README's earlier rows).
  const Case cases[] = {
      {"glm5 decode", 1, 32, 4000, 2048},     {"glm5 decode below top_k", 1, 32, 1500, 2048},
      {"glm5 decode", 1, 32, 16384, 2048},    {"glm5 decode", 1, 32, 131072, 2048},
      {"glm5 MTP", 4, 32, 4000, 2048},        {"glm5 MTP", 4, 32, 16384, 2048},
      {"64h decode", 1, 64, 16384, 2048},     {"64h decode", 1, 64, 131072, 2048},
  };
  for (const Case& c : cases) {
    const std::string label = std::string(c.name) + " " + std::to_string(c.keys);  // --only matches it
    if (!only.empty() && label.find(only) == std::string::npos) continue;
    // Both decode selections side by side (IndexerDecodeSelect::kAuto picks one of them).
    for (IndexerDecodeSelect path : {IndexerDecodeSelect::kFiltered, IndexerDecodeSelect::kOneBlock}) {
      RunCase(c, path, d.copy_bw, d.num_sms, d.stream);
    }
    if (quick) break;
  }
  BENCH_CHECK(cudaStreamDestroy(d.stream));
  return 0;
}
