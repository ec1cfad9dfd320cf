// trellis_v1's encode speed on the GPU against the CPU (issue #16; bench/README.md, "The trellis
// encoder on the GPU"): a measurement, not a test.
//
//   1. The tile search alone: --tiles unit-Gaussian tiles on the GPU, and the first --cpu_tiles
//      of them on the CPU's every core (one TileSearcher per thread); tiles per second each, and
//      whether the symbols of the tiles both searched are equal.
//   2. Whole matrices through TrellisCodec::Encode with the GPU search, both planes: a gate/up
//      projection at DeepSeek-V3's shape (2048 x 7168, no Hessian: every tile in one search) and a
//      down projection (7168 x 2048) with an AR(1) Hessian (LDLQ: one 16-column block a search).
//
//   3. With --ldlq_workers W,...: W LDLQ encodes at once on one GPU (nq encode --device cuda
//      --workers W), --ldlq_per_worker 7168 x 2048 matrices each: wall seconds per matrix.
//
//   trellis_search_bench [--tiles N] [--cpu_tiles N] [--skip_matrices] [--ldlq_workers W,W,...]
//                        [--ldlq_per_worker N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/trellis_search.h"
#include "services/quant/codec.h"
#include "services/quant/codec_bench.h"
#include "services/quant/ldlq.h"
#include "services/quant/trellis_codec.h"
#include "services/quant/trellis_decode.h"
#include "services/quant/trellis_search.h"

namespace {

using nq::quant::trellis::kTileWeights;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

std::vector<float> GaussianTiles(int64_t tiles, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(tiles * kTileWeights));
  for (float& v : x) v = normal(rng);
  return x;
}

int Cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

std::vector<float> GaussianMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& v : w) v = normal(rng);
  return w;
}

absl::Status Encode(nq::quant::TrellisTileSearch& search, const std::vector<float>& w, int64_t rows, int64_t cols,
                    const nq::quant::Hessian* h, int host_threads) {
  nq::quant::EncodeOptions options;
  options.trellis_search = &search;
  options.host_threads = host_threads;
  return nq::quant::TrellisCodec().Encode(w, rows, cols, h, options).status();
}

int EncodeMatrix(nq::quant::TrellisTileSearch& search, int64_t rows, int64_t cols, bool ldlq, int host_threads) {
  const std::vector<float> w = GaussianMatrix(rows, cols, 11);
  const nq::quant::Hessian h = ldlq ? nq::quant::Ar1Hessian(cols, 0.9) : nq::quant::Hessian{cols, {}};
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = Encode(search, w, rows, cols, ldlq ? &h : nullptr, host_threads);
  const double s = Seconds(start);
  if (!status.ok()) {
    std::fprintf(stderr, "encode %lldx%lld failed: %s\n", static_cast<long long>(rows), static_cast<long long>(cols),
                 status.ToString().c_str());
    return 1;
  }
  const int64_t tiles = 2 * rows * cols / kTileWeights;
  std::printf("| %lld x %lld | %s | %d | %lld | %.2f | %.0f |\n", static_cast<long long>(rows),
              static_cast<long long>(cols), ldlq ? "LDLQ (AR(1) 0.9), one block a search" : "none, every tile in one search",
              host_threads, static_cast<long long>(tiles), s, static_cast<double>(tiles) / s);
  return 0;
}

// What nq encode --device cuda does with LDLQ: `workers` experts encoded at once, each worker with
// its own search on GPU 0 (its own stream) and cores / workers threads for the feedback, so one
// worker's host work overlaps the others' searches. Each encodes `per_worker` 7168 x 2048 down
// projections; prints the wall time per matrix, the release-level rate.
int EncodeConcurrently(int workers, int per_worker) {
  constexpr int64_t kRows = 7168, kCols = 2048;
  const nq::quant::Hessian h = nq::quant::Ar1Hessian(kCols, 0.9);
  std::vector<std::unique_ptr<nq::quant::TrellisTileSearch>> searches;
  std::vector<std::vector<float>> weights;
  for (int i = 0; i < workers; ++i) {
    absl::StatusOr<std::unique_ptr<nq::quant::TrellisTileSearch>> search = nq::kernels::cuda::MakeCudaTrellisTileSearch(0);
    if (!search.ok()) {
      std::fprintf(stderr, "%s\n", search.status().ToString().c_str());
      return 1;
    }
    searches.push_back(*std::move(search));
    weights.push_back(GaussianMatrix(kRows, kCols, 100 + static_cast<uint32_t>(i)));
  }
  const int host_threads = std::max(1, Cores() / workers);
  std::vector<absl::Status> status(static_cast<size_t>(workers));
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int i = 0; i < workers; ++i) {
    pool.emplace_back([&, i] {
      for (int m = 0; m < per_worker && status[i].ok(); ++m) {
        status[i] = Encode(*searches[i], weights[i], kRows, kCols, &h, host_threads);
      }
    });
  }
  for (std::thread& t : pool) t.join();
  const double s = Seconds(start);
  for (const absl::Status& st : status) {
    if (!st.ok()) {
      std::fprintf(stderr, "concurrent encode failed: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  const int matrices = workers * per_worker;
  const double tiles = 2.0 * kRows * kCols / kTileWeights * matrices;
  std::printf("| %d | %d | %d | %.2f | %.2f | %.0f |\n", workers, host_threads, matrices, s, s / matrices, tiles / s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tiles = 8192, cpu_tiles = 256;
  bool matrices = true;
  std::vector<int> ldlq_workers;
  int ldlq_per_worker = 2;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--ldlq_workers") && i + 1 < argc) {
      for (const char* p = argv[++i]; *p != '\0';) {
        char* next = nullptr;
        const long w = std::strtol(p, &next, 10);
        if (next == p || w < 1) {
          std::fprintf(stderr, "--ldlq_workers: a comma-separated list of positive counts\n");
          return 2;
        }
        ldlq_workers.push_back(static_cast<int>(w));
        p = *next == ',' ? next + 1 : next;
      }
    } else if (!std::strcmp(argv[i], "--ldlq_per_worker") && i + 1 < argc) {
      ldlq_per_worker = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--tiles") && i + 1 < argc) {
      tiles = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--cpu_tiles") && i + 1 < argc) {
      cpu_tiles = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--skip_matrices")) {
      matrices = false;
    } else {
      std::fprintf(stderr,
                   "usage: trellis_search_bench [--tiles N] [--cpu_tiles N] [--skip_matrices] [--ldlq_workers W,W,...] "
                   "[--ldlq_per_worker N]\n");
      return 2;
    }
  }
  cpu_tiles = std::min(cpu_tiles, tiles);
  absl::StatusOr<std::unique_ptr<nq::quant::TrellisTileSearch>> gpu = nq::kernels::cuda::MakeCudaTrellisTileSearch(0);
  if (!gpu.ok()) {
    std::fprintf(stderr, "%s\n", gpu.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<nq::quant::TrellisTileSearch> cpu = nq::quant::MakeCpuTrellisTileSearch(0);
  const std::vector<float> x = GaussianTiles(tiles, 5);
  std::vector<uint8_t> gpu_symbols(x.size()), cpu_symbols(static_cast<size_t>(cpu_tiles * kTileWeights));

  // A warm-up search (module load, first allocations), then the timed one.
  std::vector<uint8_t> warm(kTileWeights);
  if (absl::Status s = (*gpu)->Search(std::span<const float>(x).first(kTileWeights), warm); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  auto start = std::chrono::steady_clock::now();
  if (absl::Status s = (*gpu)->Search(x, gpu_symbols); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  const double gpu_s = Seconds(start);
  start = std::chrono::steady_clock::now();
  if (absl::Status s = cpu->Search(std::span<const float>(x).first(cpu_symbols.size()), cpu_symbols); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  const double cpu_s = Seconds(start);
  int64_t equal = 0;
  for (int64_t t = 0; t < cpu_tiles; ++t) {
    equal += std::memcmp(gpu_symbols.data() + t * kTileWeights, cpu_symbols.data() + t * kTileWeights, kTileWeights) == 0;
  }
  const double gpu_rate = static_cast<double>(tiles) / gpu_s, cpu_rate = static_cast<double>(cpu_tiles) / cpu_s;
  // A 7168 x 2048 matrix is 57344 tiles a plane, two planes.
  constexpr double kMatrixTiles = 2.0 * 7168 * 2048 / kTileWeights;
  std::printf("| search | tiles | s | tiles/s | s per 7168 x 2048 matrix (2 planes) |\n| --- | ---: | ---: | ---: | ---: |\n");
  std::printf("| %s | %lld | %.3f | %.1f | %.2f |\n", (*gpu)->where().c_str(), static_cast<long long>(tiles), gpu_s,
              gpu_rate, kMatrixTiles / gpu_rate);
  std::printf("| %s | %lld | %.3f | %.1f | %.2f |\n", cpu->where().c_str(), static_cast<long long>(cpu_tiles), cpu_s,
              cpu_rate, kMatrixTiles / cpu_rate);
  std::printf("GPU over CPU (all cores): %.1fx; symbols equal on %lld of %lld tiles searched by both\n",
              gpu_rate / cpu_rate, static_cast<long long>(equal), static_cast<long long>(cpu_tiles));
  if (equal != cpu_tiles) return 1;
  if (matrices) {
    std::printf("\n| matrix | Hessian | host threads | tiles (both planes) | encode s (GPU search) | tiles/s |\n"
                "| --- | --- | ---: | ---: | ---: | ---: |\n");
    if (EncodeMatrix(**gpu, 2048, 7168, false, Cores()) != 0) return 1;
    if (EncodeMatrix(**gpu, 7168, 2048, true, 1) != 0) return 1;
    if (EncodeMatrix(**gpu, 7168, 2048, true, Cores()) != 0) return 1;
  }
  if (ldlq_workers.empty()) return 0;
  std::printf("\nLDLQ encodes at once (7168 x 2048, AR(1) 0.9), as nq encode --device cuda --workers W runs them:\n"
              "| workers | host threads each | matrices | wall s | s per matrix | tiles/s |\n"
              "| ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (int workers : ldlq_workers) {
    if (EncodeConcurrently(workers, ldlq_per_worker) != 0) return 1;
  }
  return 0;
}
