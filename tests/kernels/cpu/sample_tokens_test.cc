// Next-token sampling where the logits are (kernels/sample_tokens.h): the integer weights
// against exp, the reference SampleRowHost on hand-worked rows (greedy, ties, the draw's walk in
// descending order, top-k, top-p, rows without a finite logit), and Backend::SampleTokens on the
// CPU backend with its argument checks. The Sampler agreement is in tests/worker/sampler_test.cc,
// the CUDA kernel's in tests/kernels/cuda/sample_tokens_test.cc.
#include "kernels/sample_tokens.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::DownloadI32;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

constexpr double kUnit = static_cast<double>(std::uint64_t{1} << kSampleWeightBits);
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

TEST(SampleWeight, IsExpInUnitsOfTwoToTheMinus40AndNeverGrowsAsTheLogitFalls) {
  EXPECT_EQ(SampleWeight(3.5f, 3.5f, 1.0f), std::uint64_t{1} << 40);
  std::uint64_t last = SampleWeight(10.0f, 10.0f, 0.7f);
  for (float logit = 10.0f; logit > -30.0f; logit -= 0.00731f) {
    const std::uint64_t w = SampleWeight(logit, 10.0f, 0.7f);
    EXPECT_LE(w, last) << "logit " << logit;
    last = w;
    const double want = std::exp((static_cast<double>(logit) - 10.0) * static_cast<double>(0.7f));  // 0.7: the inverse temperature
    EXPECT_NEAR(static_cast<double>(w) / kUnit, want, want * 2e-6 + 1.0 / kUnit) << "logit " << logit;
  }
  // Beyond 2^-40 of the best: nothing; a huge inverse temperature too.
  EXPECT_EQ(SampleWeight(-30.0f, 0.0f, 1.0f), 0u);
  EXPECT_EQ(SampleWeight(-1.0f, 0.0f, std::numeric_limits<float>::max()), 0u);
}

SampleParams Draw(float temperature, double u01, int top_k = 0, float top_p = 1) {
  return SampleParams{.u01 = u01, .temperature = temperature, .top_p = top_p, .top_k = top_k};
}

TEST(SampleRowHost, GreedyPicksTheLargestFiniteLogitTiesToTheLowerId) {
  EXPECT_EQ(SampleRowHost(std::vector<float>{1, 3, kInf, 3, kNan, -2}, Draw(0, 0)), 1);
  EXPECT_EQ(SampleRowHost(std::vector<float>{-kInf, kNan, -5}, Draw(0, 0)), 2);
  EXPECT_EQ(SampleRowHost(std::vector<float>{-kInf, kNan, kInf}, Draw(0, 0)), kNoFiniteLogit);
  EXPECT_EQ(SampleRowHost(std::vector<float>{-kInf, kNan, kInf}, Draw(1, 0.5)), kNoFiniteLogit);
}

TEST(SampleRowHost, TheDrawWalksTheIdsMostLikelyFirst) {
  // Weights 1 (id 1) and 1/3 (id 0): id 1 holds the first 3/4 of the walk.
  const std::vector<float> row = {0.0f, std::log(3.0f)};
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.0)), 1);
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.7499)), 1);
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.7501)), 0);
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.999999)), 0);
  // Temperature 0.5 squares the odds: 1 and 1/9, so id 1 holds 9/10.
  EXPECT_EQ(SampleRowHost(row, Draw(0.5f, 0.8999)), 1);
  EXPECT_EQ(SampleRowHost(row, Draw(0.5f, 0.9001)), 0);
  // Non-finite logits are never drawn.
  const std::vector<float> holes = {kNan, 0.0f, -kInf, kInf, 0.0f};
  for (double u : {0.0, 0.3, 0.6, 0.99}) {
    const std::int32_t id = SampleRowHost(holes, Draw(1, u));
    EXPECT_TRUE(id == 1 || id == 4) << id;
  }
}

TEST(SampleRowHost, EqualLogitsAreWalkedInIdOrderAndTopKKeepsTheLowerIds) {
  const std::vector<float> row(10, 0.5f);
  std::map<std::int32_t, int> seen;
  for (int i = 0; i < 30; ++i) ++seen[SampleRowHost(row, Draw(1, (i + 0.5) / 30, /*top_k=*/3))];
  EXPECT_EQ(seen, (std::map<std::int32_t, int>{{0, 10}, {1, 10}, {2, 10}}));
  // The walk's order among ties: id 0 first.
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.05)), 0);
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.95)), 9);
}

TEST(SampleRowHost, TopPKeepsTheShortestPrefixThatReachesIt) {
  // Probabilities 0.5 (id 2), 0.3 (id 0), 0.2 (id 1).
  const std::vector<float> row = {std::log(0.3f), std::log(0.2f), std::log(0.5f)};
  for (double u : {0.0, 0.5, 0.99}) {
    EXPECT_EQ(SampleRowHost(row, Draw(1, u, 0, /*top_p=*/0.5f)), 2) << u;
    EXPECT_EQ(SampleRowHost(row, Draw(1, u, 0, /*top_p=*/0.01f)), 2) << u;
  }
  // 0.6 needs ids 2 and 0 (0.8 of the row): the draw splits 5:3 between them.
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.62, 0, 0.6f)), 2);
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.63, 0, 0.6f)), 0);
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.99, 0, 0.6f)), 0);
  // Within top-k: top_k 1 leaves id 2 whatever top_p.
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.99, 1, 0.9f)), 2);
  // top_p 1 with top_k 2: ids 2 and 0 again.
  EXPECT_EQ(SampleRowHost(row, Draw(1, 0.99, 2, 1.0f)), 0);
}

// SampleRowHost (the radix descent the CUDA kernel runs too) against the definition
// (SampleRowBySort): the same id on every row, over vocabularies like DeepSeek-V3's and small odd
// ones, rows with runs of equal logits (top-k and the draw then cut inside a tie), non-finite
// entries and a flat row, at every setting and across the draw's range.
TEST(SampleRowHost, TheRadixDescentPicksWhatTheSortedDefinitionPicks) {
  std::mt19937_64 rng = ::nq::kernels::testing::MakeRng(4411);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const std::vector<SampleParams> settings = {
      Draw(1.0f, 0), Draw(0.6f, 0, 0, 0.95f), Draw(1.3f, 0, 50), Draw(0.8f, 0, 1000, 0.3f),
      Draw(0.05f, 0), Draw(2.0f, 0, 3, 0.999f), Draw(1.0f, 0, 1), Draw(0.7f, 0, 7, 0.5f),
  };
  int rows = 0;
  for (const std::int64_t vocab : {std::int64_t{129280}, std::int64_t{1001}, std::int64_t{7}}) {
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<float> logits = ::nq::kernels::testing::RandomNormal(rng, static_cast<size_t>(vocab), 2.5f);
      if (kind == 1) {
        for (float& l : logits) l = std::round(l * 2) / 2;
      } else if (kind == 2) {
        for (size_t i = 0; i < logits.size(); i += 13) logits[i] = -kInf;
        for (size_t i = 5; i < logits.size(); i += 29) logits[i] = kNan;
      } else if (kind == 3) {
        std::fill(logits.begin(), logits.end(), 0.25f);
      }
      for (const SampleParams& base : settings) {
        for (int draw = 0; draw < (vocab > 2000 ? 3 : 12); ++draw) {
          SampleParams p = base;
          p.u01 = draw == 0 ? 0.9999999 : uniform(rng);
          ASSERT_EQ(SampleRowHost(logits, p), SampleRowBySort(logits, p))
              << "vocab " << vocab << " kind " << kind << " temperature " << p.temperature << " top_p " << p.top_p
              << " top_k " << p.top_k << " u01 " << p.u01;
          ++rows;
        }
      }
    }
  }
  EXPECT_GT(rows, 500);
}

TEST(SampleTokens, TheCpuBackendSamplesEachRowWithItsOwnParameters) {
  auto backend = MakeCpuBackend();
  const std::vector<float> logits = {0.0f, std::log(3.0f), 7.0f, 1.0f, 9.0f, 2.0f};
  const std::vector<SampleParams> params = {Draw(1, 0.9), Draw(0, 0)};
  Tensor l = Upload(*backend, logits, DType::kF32, {2, 3});
  Tensor p = AllocateOrFail(*backend, DType::kU8, {2, static_cast<std::int64_t>(sizeof(SampleParams))});
  std::memcpy(p.data_as<std::uint8_t>(), params.data(), sizeof(SampleParams) * params.size());
  Tensor ids = AllocateOrFail(*backend, DType::kI32, {2});
  NQ_ASSERT_OK(backend->SampleTokens(l, p, ids));
  // Row 0 (weights 1, 3, e^7 / e^(ln 3)...): the same as the reference; row 1 greedy.
  EXPECT_EQ(DownloadI32(*backend, ids),
            (std::vector<std::int32_t>{SampleRowHost(std::span<const float>(logits).first(3), params[0]), 1}));
}

TEST(SampleTokens, RefusesParametersAndShapesItCannotSampleWith) {
  auto backend = MakeCpuBackend();
  Tensor l = Upload(*backend, std::vector<float>{1, 2, 3}, DType::kF32, {1, 3});
  Tensor ids = AllocateOrFail(*backend, DType::kI32, {1});
  Tensor p = AllocateOrFail(*backend, DType::kU8, {1, static_cast<std::int64_t>(sizeof(SampleParams))});
  auto with = [&](SampleParams params) {
    std::memcpy(p.data_as<std::uint8_t>(), &params, sizeof(params));
    return backend->SampleTokens(l, p, ids);
  };
  EXPECT_THAT(with(Draw(-1, 0)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("row 0: temperature")));
  EXPECT_THAT(with(Draw(kInf, 0)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("temperature")));
  EXPECT_THAT(with(Draw(1, 0, 0, 0.0f)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p")));
  EXPECT_THAT(with(Draw(1, 0, 0, 1.5f)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p")));
  EXPECT_THAT(with(Draw(1, 0, -1)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  EXPECT_THAT(with(Draw(1, 1.0)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("u01")));
  NQ_EXPECT_OK(with(Draw(1, 0.5)));
  Tensor short_params = AllocateOrFail(*backend, DType::kU8, {1, 16});
  EXPECT_THAT(backend->SampleTokens(l, short_params, ids),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("params")));
  Tensor two_ids = AllocateOrFail(*backend, DType::kI32, {2});
  EXPECT_THAT(backend->SampleTokens(l, p, two_ids), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ids")));
  Tensor f32_ids = AllocateOrFail(*backend, DType::kF32, {1});
  EXPECT_THAT(backend->SampleTokens(l, p, f32_ids), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ids")));
}

}  // namespace
}  // namespace nq::kernels
