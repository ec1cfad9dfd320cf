// trellis_v1 on the GPU. (a) kernels/cuda/trellis_tile.cuh decodes every weight of random tiles
// exactly as the CPU decoder (services/quant/trellis_decode.h) does: the fp16 integer S - 510,
// scaled by 1/147.8005 on the host, equals trellis::UnitValue bit for bit, in the mma A-fragment
// positions, per single weight and per tile row. (b) The CUDA NqMoe prefill path vs the CPU
// backend on random trellis layers, 16 and 512 tokens, every expert at 2 bits, at 4 bits and a
// mix, and the decode GEMV path for 1, 4 and 7 tokens; tolerance 2e-3 of the largest output
// (issue #12).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "services/quant/trellis_decode.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/cuda/trellis_tile_probe.h"
#include "tests/kernels/nq_moe_fixture.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

namespace trellis = ::nq::quant::trellis;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;

constexpr double kTolerance = 2e-3;

// The byte sum of a state's hash, by a byte loop (not UnitValue's paired adds).
int HostByteSum(std::uint32_t state) {
  const std::uint32_t x = state * trellis::kHashMul + trellis::kHashAdd;
  int sum = 0;
  for (int b = 0; b < 4; ++b) sum += static_cast<int>((x >> (8 * b)) & 0xFFu);
  return sum;
}

// Checks one device weight (fp16 bits of S - 510) of tile `words` at (r, c) against the host.
void ExpectWeight(const std::uint32_t* words, int r, int c, std::uint16_t half_bits, const char* what) {
  const std::uint32_t state = trellis::TileState(words, trellis::kTileDim * r + c);
  const float centred = ToFloat(F16{half_bits});
  EXPECT_EQ(centred, static_cast<float>(HostByteSum(state) - 510)) << what << " (" << r << ", " << c << ")";
  // (S - 510) * 1/147.8005 in float is UnitValue's own last step, so equal bits are required.
  EXPECT_EQ(centred * trellis::kInvByteSumSd, trellis::UnitValue(state)) << what << " (" << r << ", " << c << ")";
}

TEST(CudaNqMoeTrellis, TileDecodeMatchesTheHostDecoderBitForBit) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4401);
  constexpr int kRandomTiles = 256;
  std::vector<std::uint32_t> words;
  // All-zero and all-one tiles (every state 0 / 0xFFFF), then uniform random tiles.
  words.insert(words.end(), trellis::kTileWords, 0u);
  words.insert(words.end(), trellis::kTileWords, 0xFFFFFFFFu);
  std::uniform_int_distribution<std::uint32_t> word;
  for (int i = 0; i < kRandomTiles * trellis::kTileWords; ++i) words.push_back(word(rng));
  const int tiles = static_cast<int>(words.size()) / trellis::kTileWords;

  absl::StatusOr<testing::TrellisTileProbe> probe = testing::ProbeTrellisTiles(words);
  ASSERT_TRUE(probe.ok()) << probe.status();
  for (int tile = 0; tile < tiles; ++tile) {
    SCOPED_TRACE(absl::StrCat("tile ", tile));
    const std::uint32_t* w = words.data() + tile * trellis::kTileWords;
    // A fragment: lane 4g + j holds a0 (g, 2j..), a1 (g + 8, 2j..), a2 (g, 2j + 8..), a3 (g + 8, 2j + 8..).
    std::vector<int> seen(trellis::kTileWeights, 0);
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, j = lane % 4;
      for (int k = 0; k < 8; ++k) {
        const int reg = k / 2;
        const int r = g + (reg % 2) * 8;
        const int c = 2 * j + (reg / 2) * 8 + k % 2;
        ExpectWeight(w, r, c, probe->fragment[(tile * 32 + lane) * 8 + k], "fragment");
        ++seen[trellis::kTileDim * r + c];
      }
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), trellis::kTileWeights) << "the fragments cover the tile once";
    for (int t = 0; t < trellis::kTileWeights; ++t) {
      const int r = t / trellis::kTileDim, c = t % trellis::kTileDim;
      ExpectWeight(w, r, c, probe->single[tile * trellis::kTileWeights + t], "CentredWeight");
      ExpectWeight(w, r, c, probe->row[tile * trellis::kTileWeights + t], "TileRow");
      EXPECT_EQ(probe->single_int[tile * trellis::kTileWeights + t],
                HostByteSum(trellis::TileState(w, t)) - 510) << "CentredWeightInt (" << r << ", " << c << ")";
    }
    if (::testing::Test::HasFailure()) break;  // one tile's failures say enough
  }
}

// Random trellis layers through both backends at 2 bits, 4 bits and a random mix, for each token
// count: the largest error as a share of the largest output goes into `summary`.
void CompareWithCpu(std::mt19937_64& rng, std::initializer_list<std::int64_t> token_counts, ErrorSummary& summary) {
  struct Shape4 {
    std::int64_t hidden, intermediate, experts, top_k;
  };
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  // 4096 x 512: rows of 16 steps (256 tiles), the decode GEMV's long-row case; 320 x 48: rows
  // ending inside a step.
  // 64 x 64 with 4 experts: 256 tokens take the dense (cuBLAS) prefill, small enough for the
  // sanitizer runs.
  for (const Shape4 s : {Shape4{256, 64, 33, 5}, Shape4{64, 64, 8, 2}, Shape4{256, 128, 16, 4}, Shape4{1024, 256, 32, 8},
                         Shape4{320, 48, 12, 3}, Shape4{4096, 512, 16, 4}, Shape4{64, 64, 4, 2}}) {
    if (small && s.hidden > 320) continue;
    const bool prefill_shape = s.hidden % 64 == 0 && s.intermediate % 64 == 0;
    const testing::NqMoeHost host = testing::RandomTrellisNqMoe(rng, s.hidden, s.intermediate, s.experts);
    for (const std::int64_t tokens : token_counts) {
      if (tokens >= 16 && !prefill_shape) continue;  // the prefill GEMM takes multiples of 64
      if (tokens == 512 && (s.hidden > 256 || small)) continue;  // the CPU oracle's time, not the kernel's limit
      if (s.hidden > 1024 && tokens > 4) continue;
      if (tokens == 256 && s.experts != 4) continue;
      const std::vector<float> x = RandomNormal(rng, tokens * s.hidden, 1.0f);
      // Tokens draw from the first 2K experts only, so the groups of the prefill GEMM hold many tokens.
      const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, tokens, s.top_k, s.experts, 2 * s.top_k);
      for (int mode = 0; mode < 3; ++mode) {
        const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, s.experts, mode);
        SCOPED_TRACE(absl::StrCat("D ", s.hidden, " I ", s.intermediate, " E ", s.experts, " K ", s.top_k, " T ",
                                  tokens, " mode ", mode));
        const std::vector<float> want = testing::RunNqMoe(*Backends().cpu, host, slots, x, routing, s.top_k);
        const std::vector<float> got = testing::RunNqMoe(*Backends().cuda, host, slots, x, routing, s.top_k);
        summary.Add(NormalizedError(got, want));
      }
    }
  }
}

TEST(CudaNqMoeTrellis, PrefillMatchesCpuAtTwoFourAndMixedBits) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4402);
  ErrorSummary summary("NqMoe trellis prefill", kTolerance);
  CompareWithCpu(rng, {16, 256, 512}, summary);
}

// The decode GEMV (up to 15 tokens: chunks of 4) decodes trellis tiles into MMA fragments.
TEST(CudaNqMoeTrellis, DecodeMatchesCpuAtTwoFourAndMixedBits) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4403);
  ErrorSummary summary("NqMoe trellis decode", kTolerance);
  CompareWithCpu(rng, {1, 4, 7}, summary);
}

}  // namespace
}  // namespace nq::kernels
