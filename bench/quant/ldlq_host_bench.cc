// ldlq_host_bench: the host's share of one trellis_v1 LDLQ encode (issue #16), without the search.
// With --device cuda the tiles are searched on the GPU and each worker's host threads do the rest:
// the rotation and scales, the feedback factor, and the error fed forward after every 16-column
// block. This times exactly that part: the same TrellisCodec::Encode over a search that returns
// symbol 0 for every weight (the host does the same work whatever symbols come back).
//
//   ldlq_host_bench [--rows 7168] [--cols 2048] [--threads 1] [--rounds 2]
//
// Prints seconds per matrix for each round (thread count and shape in the line).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "services/quant/codec_bench.h"
#include "services/quant/ldlq.h"
#include "services/quant/trellis_codec.h"
#include "services/quant/trellis_search.h"

namespace {

// Symbol 0 everywhere, at memset speed: what the host does after a search does not depend on it.
class ZeroSearch final : public nq::quant::TrellisTileSearch {
 public:
  std::string where() const override { return "none (symbol 0 everywhere)"; }
  absl::Status Search(std::span<const float> targets, std::span<uint8_t> symbols) override {
    if (absl::Status s = nq::quant::CheckTileSearchArguments(targets, symbols); !s.ok()) return s;
    std::memset(symbols.data(), 0, symbols.size());
    return absl::OkStatus();
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 7168, cols = 2048;
  int threads = 1, rounds = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const long long v = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rows")) rows = v;
    else if (!std::strcmp(argv[i], "--cols")) cols = v;
    else if (!std::strcmp(argv[i], "--threads")) threads = static_cast<int>(v);
    else if (!std::strcmp(argv[i], "--rounds")) rounds = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: ldlq_host_bench [--rows N] [--cols N] [--threads N] [--rounds N]\n");
      return 2;
    }
  }
  if (rows <= 0 || cols <= 0 || rows % 16 != 0 || cols % 16 != 0 || threads < 1 || rounds < 1) {
    std::fprintf(stderr, "ldlq_host_bench: rows and cols must be positive multiples of 16, threads and rounds >= 1\n");
    return 2;
  }
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& v : w) v = normal(rng);
  const nq::quant::Hessian h = nq::quant::Ar1Hessian(cols, 0.9);
  ZeroSearch search;
  nq::quant::EncodeOptions options;
  options.trellis_search = &search;
  options.host_threads = threads;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto m = nq::quant::TrellisCodec().Encode(w, rows, cols, &h, options);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!m.ok()) {
      std::fprintf(stderr, "encode failed: %s\n", m.status().ToString().c_str());
      return 1;
    }
    std::printf("%lld x %lld, LDLQ (AR(1) 0.9), %d host thread(s), round %d: %.2f s per matrix (host share)\n",
                static_cast<long long>(rows), static_cast<long long>(cols), threads, r + 1, s);
  }
  return 0;
}
