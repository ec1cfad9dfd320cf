#include "services/quant/trellis_search.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/quant/trellis_decode.h"
#include "services/quant/trellis_viterbi.h"

namespace nq::quant {
namespace {

using trellis::kTileWeights;

class CpuTrellisTileSearch final : public TrellisTileSearch {
 public:
  explicit CpuTrellisTileSearch(int threads) {
    searchers_.reserve(threads);
    for (int w = 0; w < threads; ++w) {
      searchers_.push_back(std::make_unique<trellis::TileSearcher>(trellis::UnitValues()));
    }
  }

  std::string where() const override {
    return absl::StrCat("cpu, ", searchers_.size(), searchers_.size() == 1 ? " thread" : " threads");
  }

  absl::Status Search(std::span<const float> targets, std::span<uint8_t> symbols) override {
    if (absl::Status s = CheckTileSearchArguments(targets, symbols); !s.ok()) return s;
    const int64_t tiles = static_cast<int64_t>(targets.size()) / kTileWeights;
    // Tiles are handed out one at a time: a search takes tens of ms, so the counter costs nothing.
    std::atomic<int64_t> next{0};
    auto work = [&](trellis::TileSearcher& searcher) {
      float decoded[kTileWeights];
      for (int64_t t = next.fetch_add(1); t < tiles; t = next.fetch_add(1)) {
        searcher.Search(targets.data() + t * kTileWeights, symbols.data() + t * kTileWeights, decoded);
      }
    };
    const int workers = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(searchers_.size()), tiles));
    std::vector<std::thread> pool;
    for (int w = 1; w < workers; ++w) pool.emplace_back([&, w] { work(*searchers_[w]); });
    if (workers > 0) work(*searchers_[0]);
    for (std::thread& t : pool) t.join();
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<trellis::TileSearcher>> searchers_;  // one per thread, reused
};

}  // namespace

absl::Status CheckAgreesWithCpuSearch(TrellisTileSearch& search) {
  std::mt19937 rng(20261206);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> targets;
  for (float scale : {1.0f, 1.0f, 1.0f, 1.0f, 3.0f, 0.1f, 100.0f}) {
    for (int i = 0; i < kTileWeights; ++i) targets.push_back(scale * normal(rng));
  }
  targets.insert(targets.end(), kTileWeights, 0.0f);
  for (int i = 0; i < kTileWeights; ++i) targets.push_back(i % 2 == 0 ? 1.5f : -1.5f);
  std::vector<uint8_t> want(targets.size()), got(targets.size(), 0xFF);
  if (absl::Status s = MakeCpuTrellisTileSearch(0)->Search(targets, want); !s.ok()) return s;
  if (absl::Status s = search.Search(targets, got); !s.ok()) return s;
  for (size_t t = 0; t < targets.size() / kTileWeights; ++t) {
    if (!std::equal(want.begin() + t * kTileWeights, want.begin() + (t + 1) * kTileWeights, got.begin() + t * kTileWeights)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "trellis search on ", search.where(), " gives other symbols than the CPU search (test tile ", t,
          "): its releases would differ from the CPU's; encode with --device cpu"));
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<TrellisTileSearch> MakeCpuTrellisTileSearch(int threads) {
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return std::make_unique<CpuTrellisTileSearch>(threads);
}

}  // namespace nq::quant
