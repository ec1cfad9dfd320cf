// The CUDA trellis search (kernels/cuda/trellis_search.cu) against the CPU TileSearcher: the
// same symbols on every tile, bit for bit, including tiles whose searches are all ties; and a
// trellis_v1 matrix encoded through either search is the same bytes, with and without LDLQ.
// Needs a GPU: run on the device machine (scripts/device/run_trellis_search.sh).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cuda/trellis_search.h"
#include "services/quant/codec.h"
#include "services/quant/ldlq.h"
#include "services/quant/trellis_codec.h"
#include "services/quant/trellis_decode.h"
#include "services/quant/trellis_search.h"

namespace nq::kernels::cuda {
namespace {

using quant::trellis::kTileWeights;

std::unique_ptr<quant::TrellisTileSearch> CudaSearchOrDie() {
  absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> search = MakeCudaTrellisTileSearch(0);
  EXPECT_TRUE(search.ok()) << search.status();
  return search.ok() ? std::move(*search) : nullptr;
}

// Tiles of every kind the codec hands over: unit Gaussians (most), scaled ones, and degenerate
// tiles whose search is ties everywhere (zeros, a constant, a two-valued pattern, huge values).
std::vector<float> MixedTiles(int gaussian_tiles) {
  std::mt19937 rng(20261203);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x;
  for (int t = 0; t < gaussian_tiles; ++t) {
    const float scale = t % 7 == 3 ? 3.0f : t % 7 == 5 ? 0.1f : 1.0f;
    for (int i = 0; i < kTileWeights; ++i) x.push_back(scale * normal(rng));
  }
  x.insert(x.end(), kTileWeights, 0.0f);
  x.insert(x.end(), kTileWeights, 0.7f);
  for (int i = 0; i < kTileWeights; ++i) x.push_back(i % 2 == 0 ? 1.5f : -1.5f);
  for (int i = 0; i < kTileWeights; ++i) x.push_back(1000.0f * normal(rng));
  return x;
}

TEST(CudaTrellisSearch, SymbolsEqualTheCpuSearchersOnEveryTile) {
  std::unique_ptr<quant::TrellisTileSearch> gpu = CudaSearchOrDie();
  ASSERT_NE(gpu, nullptr);
  // More tiles than the GPU runs blocks, so blocks loop over tiles and reuse their scratch.
  const std::vector<float> x = MixedTiles(300);
  std::vector<uint8_t> want(x.size()), got(x.size(), 0xFF);
  ASSERT_TRUE(quant::MakeCpuTrellisTileSearch(0)->Search(x, want).ok());
  ASSERT_TRUE(gpu->Search(x, got).ok());
  int bad_tiles = 0;
  for (size_t t = 0; t < x.size() / kTileWeights; ++t) {
    for (int i = 0; i < kTileWeights; ++i) {
      if (got[t * kTileWeights + i] != want[t * kTileWeights + i]) {
        if (++bad_tiles <= 5) ADD_FAILURE() << "tile " << t << " first differs at symbol " << i;
        break;
      }
    }
  }
  EXPECT_EQ(bad_tiles, 0) << "of " << x.size() / kTileWeights << " tiles (" << gpu->where() << ")";
}

// One tile: small enough for compute-sanitizer's memcheck and racecheck (the device script).
TEST(CudaTrellisSearch, OneTileEqualsTheCpuSearchers) {
  std::unique_ptr<quant::TrellisTileSearch> gpu = CudaSearchOrDie();
  ASSERT_NE(gpu, nullptr);
  const std::vector<float> tiles = MixedTiles(1);
  const std::vector<float> x(tiles.begin(), tiles.begin() + kTileWeights);
  std::vector<uint8_t> want(x.size()), got(x.size(), 0xFF);
  ASSERT_TRUE(quant::MakeCpuTrellisTileSearch(1)->Search(x, want).ok());
  ASSERT_TRUE(gpu->Search(x, got).ok());
  EXPECT_EQ(got, want);
}

TEST(CudaTrellisSearch, ASecondSearchOnTheSameSearcherGivesTheSameSymbols) {
  std::unique_ptr<quant::TrellisTileSearch> gpu = CudaSearchOrDie();
  ASSERT_NE(gpu, nullptr);
  const std::vector<float> x = MixedTiles(40);
  std::vector<uint8_t> first(x.size()), second(x.size());
  ASSERT_TRUE(gpu->Search(x, first).ok());
  // A smaller batch first, then the same one: buffers kept, scratch reused.
  std::vector<uint8_t> small(kTileWeights);
  ASSERT_TRUE(gpu->Search(std::span<const float>(x).first(kTileWeights), small).ok());
  ASSERT_TRUE(gpu->Search(x, second).ok());
  EXPECT_EQ(first, second);
  EXPECT_TRUE(std::equal(small.begin(), small.end(), first.begin()));
}

TEST(CudaTrellisSearch, RefusesWhatIsNotWholeTilesAndAcceptsNothing) {
  std::unique_ptr<quant::TrellisTileSearch> gpu = CudaSearchOrDie();
  ASSERT_NE(gpu, nullptr);
  std::vector<float> x(kTileWeights + 3, 0.5f);
  std::vector<uint8_t> s(x.size());
  absl::Status partial = gpu->Search(x, s);
  EXPECT_EQ(partial.code(), absl::StatusCode::kInvalidArgument) << partial;
  EXPECT_NE(partial.message().find("whole 256-weight tiles"), std::string::npos) << partial;
  x.resize(kTileWeights);
  absl::Status short_output = gpu->Search(x, std::span<uint8_t>(s).first(kTileWeights - 1));
  EXPECT_EQ(short_output.code(), absl::StatusCode::kInvalidArgument) << short_output;
  EXPECT_TRUE(gpu->Search({}, {}).ok());
  EXPECT_EQ(MakeCudaTrellisTileSearch(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCudaTrellisTileSearch(1000).status().code(), absl::StatusCode::kInvalidArgument);
}

// A whole trellis_v1 encode (gains, the residual's targets from the decoded base, LDLQ's
// feedback between blocks) through either search: every byte and gain the same.
TEST(CudaTrellisSearch, EncodedMatricesAreTheCpuEncodersBytes) {
  std::unique_ptr<quant::TrellisTileSearch> gpu = CudaSearchOrDie();
  ASSERT_NE(gpu, nullptr);
  constexpr int64_t kRows = 64, kCols = 128, kSamples = 512;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(kRows * kCols);
  for (float& v : w) v = normal(rng);
  // A calibration Hessian from activations with AR(1)-correlated features.
  std::vector<float> x(kSamples * kCols);
  for (int64_t s = 0; s < kSamples; ++s) {
    float prev = normal(rng);
    for (int64_t c = 0; c < kCols; ++c) {
      prev = 0.9f * prev + std::sqrt(1.0f - 0.81f) * normal(rng);
      x[s * kCols + c] = prev;
    }
  }
  absl::StatusOr<quant::Hessian> hessian_or = quant::HessianFromActivations(x, kSamples, kCols);
  ASSERT_TRUE(hessian_or.ok()) << hessian_or.status();
  const quant::Hessian& hessian = *hessian_or;
  const quant::TrellisCodec codec;
  for (const quant::Hessian* with : {static_cast<const quant::Hessian*>(nullptr), &hessian}) {
    SCOPED_TRACE(with == nullptr ? "identity Hessian" : "LDLQ");
    quant::EncodeOptions options;
    options.rotation = {.row_block = kRows, .col_block = kCols};
    absl::StatusOr<quant::EncodedMatrix> cpu = codec.Encode(w, kRows, kCols, with, options);
    options.trellis_search = gpu.get();
    absl::StatusOr<quant::EncodedMatrix> cuda = codec.Encode(w, kRows, kCols, with, options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    EXPECT_EQ(cuda->base_codes, cpu->base_codes);
    EXPECT_EQ(cuda->residual_codes, cpu->residual_codes);
    EXPECT_EQ(cuda->params.base_codebook, cpu->params.base_codebook);
    EXPECT_EQ(cuda->params.residual_codebook, cpu->params.residual_codebook);
    EXPECT_EQ(cuda->row_scales, cpu->row_scales);
    EXPECT_EQ(cuda->col_scales, cpu->col_scales);
  }
}

}  // namespace
}  // namespace nq::kernels::cuda
