// CUDA IndexerTopK vs the CPU backend. With small-integer inputs every score is exact in fp32
// (and in the CUDA kernel's 3xTF32 products), so the selections, ties and order included, must
// be identical; with random normal inputs the CUDA scores may reorder near-ties, so each selected
// key is checked against the CPU's k-th best double score within a stated tolerance. Covers
// decode (T <= 4) and chunked prefill, 1 to 131072 keys, ties, NaN and non-positive scores, fewer
// visible keys than top_k, and each path of the radix select (see indexer_select.cuh).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::RefIndexerScores;
using ::nq::kernels::testing::RunIndexerTopK;
using ::nq::kernels::testing::StatusIs;
using ::testing::HasSubstr;

struct Case {
  std::int64_t tokens, heads, dim, keys, start_pos, top_k;
};

std::string Describe(const Case& c) {
  return absl::StrCat("T=", c.tokens, " Hi=", c.heads, " d=", c.dim, " S=", c.keys,
                      " start=", c.start_pos, " top_k=", c.top_k);
}

// A decode (or MTP verification) step: the last `tokens` of `keys` positions.
Case Decode(std::int64_t tokens, std::int64_t keys, std::int64_t top_k) {
  return {tokens, 64, 128, keys, keys - tokens, top_k};
}

std::vector<float> SmallInts(std::mt19937_64& rng, std::size_t count, int lo, int hi) {
  std::vector<float> out(count);
  for (float& v : out) v = static_cast<float>(RandomInt(rng, lo, hi));
  return out;
}

std::vector<std::int32_t> Select(Backend& backend, const Case& c, const std::vector<float>& q,
                                 const std::vector<float>& k, const std::vector<float>& w) {
  return RunIndexerTopK(backend, q, k, w, c.tokens, c.heads, c.dim, c.keys, c.start_pos, c.top_k);
}

// q, k in {-1, 0, 1}, weights in [w_lo, w_hi]: |score| <= 2 * heads * dim, exact in fp32.
void ExpectIntegerCaseMatchesCpu(std::mt19937_64& rng, const Case& c, int w_lo = 1,
                                 int w_hi = 2) {
  SCOPED_TRACE(Describe(c));
  const std::vector<float> q = SmallInts(rng, c.tokens * c.heads * c.dim, -1, 1);
  const std::vector<float> k = SmallInts(rng, c.keys * c.dim, -1, 1);
  const std::vector<float> w = SmallInts(rng, c.tokens * c.heads, w_lo, w_hi);
  EXPECT_TRUE(Select(*Backends().cuda, c, q, k, w) == Select(*Backends().cpu, c, q, k, w));
}

TEST(CudaIndexerTopK, DecodeIntegerScoresSelectExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3701);
  // DSA shapes (64 heads of 128), one to four tokens, around the top_k and tile boundaries.
  for (std::int64_t keys : {1, 31, 2047, 2048, 2049, 16384, 131072}) {
    for (std::int64_t top_k : {2048, 7}) {
      for (std::int64_t tokens : {1, 4}) {
        if (tokens > keys) continue;
        ExpectIntegerCaseMatchesCpu(rng, Decode(tokens, keys, top_k));
      }
    }
  }
}

TEST(CudaIndexerTopK, PrefillIntegerScoresSelectExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3704);
  // The 300-token chunk at start_pos 15800 needs more than the backend's 16 MiB of scores (260
  // rows of 16100 keys): it is scored in two chunks; so is the one at 131008 (32 rows a chunk).
  std::vector<Case> cases = {{1, 1, 1, 1, 0, 1},          {7, 3, 5, 7, 0, 4},
                             {300, 8, 32, 300, 0, 64},     {300, 2, 8, 16100, 15800, 16},
                             {2, 4, 16, 16384, 16382, 3000}, {64, 4, 16, 131072, 131008, 2048},
                             {40, 64, 128, 2100, 2060, 2048}, {33, 24, 40, 500, 467, 100}};
  for (int i = 0; i < 4; ++i) {
    const std::int64_t tokens = RandomInt(rng, 1, 50);
    const std::int64_t start = RandomInt(rng, 0, 3000);
    cases.push_back({tokens, RandomInt(rng, 1, 16), RandomInt(rng, 1, 128), start + tokens, start,
                     RandomInt(rng, 1, 600)});
  }
  for (const Case& c : cases) ExpectIntegerCaseMatchesCpu(rng, c);
}

// Small enough for compute-sanitizer's racecheck: every block phase, padding, -1s.
TEST(CudaIndexerTopK, TinyIntegerCasesSelectExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3703);
  for (const Case& c : {Case{3, 2, 8, 40, 37, 8}, Case{5, 3, 4, 2100, 2095, 50}}) {
    ExpectIntegerCaseMatchesCpu(rng, c);
  }
}

TEST(CudaIndexerTopK, DuplicateKeysTieToTheLowerKey) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3705);
  for (const Case& c : {Decode(1, 16384, 2048), Decode(2, 131072, 2048), Case{9, 4, 16, 5000, 4991, 300}}) {
    SCOPED_TRACE(Describe(c));
    // Every key is one of 37 distinct rows: each score is shared by hundreds of keys.
    const std::vector<float> pool = SmallInts(rng, 37 * c.dim, -1, 1);
    std::vector<float> k(c.keys * c.dim);
    for (std::int64_t s = 0; s < c.keys; ++s) {
      const std::int64_t row = RandomInt(rng, 0, 36);
      std::copy_n(pool.begin() + row * c.dim, c.dim, k.begin() + s * c.dim);
    }
    const std::vector<float> q = SmallInts(rng, c.tokens * c.heads * c.dim, -1, 1);
    const std::vector<float> w = SmallInts(rng, c.tokens * c.heads, 1, 2);
    EXPECT_TRUE(Select(*Backends().cuda, c, q, k, w) == Select(*Backends().cpu, c, q, k, w));
  }
}

TEST(CudaIndexerTopK, NanScoresRankLast) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3706);
  for (const Case& c : {Decode(1, 16384, 2048), Case{6, 8, 32, 3000, 2994, 2048}}) {
    SCOPED_TRACE(Describe(c));
    const std::vector<float> q = SmallInts(rng, c.tokens * c.heads * c.dim, -1, 1);
    const std::vector<float> k = SmallInts(rng, c.keys * c.dim, -1, 1);
    std::vector<float> w = SmallInts(rng, c.tokens * c.heads, 1, 2);
    // A NaN head weight makes every key with a positive dot for that head score NaN: most keys.
    for (std::int64_t t = 0; t < c.tokens; t += 2) w[t * c.heads] = std::nanf("");
    EXPECT_TRUE(Select(*Backends().cuda, c, q, k, w) == Select(*Backends().cpu, c, q, k, w));
  }
}

TEST(CudaIndexerTopK, NonPositiveScoresSelectExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3707);
  // Negative head weights: scores <= 0, a third of them exactly 0 (no positive dot).
  for (const Case& c : {Decode(1, 16384, 2048), Decode(1, 131072, 2048), Case{5, 3, 8, 4000, 3995, 64}}) {
    ExpectIntegerCaseMatchesCpu(rng, c, -2, -1);
  }
}

TEST(CudaIndexerTopK, AllScoresZeroSelectTheLowestKeys) {
  if (Backends().cuda == nullptr) return;
  // Every dot is negative, so relu makes every score 0: one tie over all keys, which every radix
  // digit fails to split; the lowest keys must win, in key order.
  for (const Case& c : {Decode(1, 131072, 2048), Decode(3, 16384, 2048), Case{4, 2, 8, 2049, 2045, 2048}}) {
    SCOPED_TRACE(Describe(c));
    const std::vector<float> q(c.tokens * c.heads * c.dim, 1.0f);
    const std::vector<float> k(c.keys * c.dim, -1.0f);
    const std::vector<float> w(c.tokens * c.heads, 1.0f);
    const std::vector<std::int32_t> got = Select(*Backends().cuda, c, q, k, w);
    ASSERT_EQ(got.size(), static_cast<std::size_t>(c.tokens * c.top_k));
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      const std::int64_t visible = c.start_pos + t + 1;
      for (std::int64_t j = 0; j < c.top_k; ++j) {
        ASSERT_EQ(got[t * c.top_k + j], j < visible ? j : -1) << "t=" << t << " j=" << j;
      }
    }
  }
}

// Integer scores 1024..2047 (one key dim, one head): the top digit has only four buckets, each
// larger than the candidate buffer, so the second digit picks the bucket (then ties by key).
TEST(CudaIndexerTopK, CrowdedTopDigitSelectsExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3708);
  const Case c{2, 1, 1, 131072, 131070, 2048};
  const std::vector<float> q(c.tokens, 1.0f);
  const std::vector<float> k = SmallInts(rng, c.keys, 1024, 2047);
  const std::vector<float> w(c.tokens, 1.0f);
  EXPECT_TRUE(Select(*Backends().cuda, c, q, k, w) == Select(*Backends().cpu, c, q, k, w));
}

// Tolerance: a selected key's exact (double) score may fall short of the exact k-th best by at
// most kScoreTolerance x max(1, |best score|). 3xTF32 products are ~2^-21 relative, and the fp32
// sums over 128 dims and 64 heads stay well inside 1e-5 of the largest score.
constexpr double kScoreTolerance = 1e-5;

TEST(CudaIndexerTopK, RandomScoresSelectAValidTopK) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3702);
  const std::vector<Case> cases = {Decode(1, 4096, 2048), Decode(1, 16384, 2048),
                                   Decode(1, 131072, 2048), Decode(4, 16384, 2048),
                                   {64, 16, 64, 600, 500, 100}};
  for (const Case& c : cases) {
    SCOPED_TRACE(Describe(c));
    const std::vector<float> q = RandomNormal(rng, c.tokens * c.heads * c.dim, 1.0f);
    const std::vector<float> k = RandomNormal(rng, c.keys * c.dim, 1.0f);
    const std::vector<float> w = RandomUniform(rng, c.tokens * c.heads, 0.0f, 0.1f);
    const std::vector<std::int32_t> got = Select(*Backends().cuda, c, q, k, w);
    ASSERT_EQ(got.size(), static_cast<std::size_t>(c.tokens * c.top_k));
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      std::vector<double> scores = RefIndexerScores(q, k, w, c.heads, c.dim, c.start_pos, t);
      const std::int64_t visible = static_cast<std::int64_t>(scores.size());
      std::vector<double> sorted = scores;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const std::int64_t take = std::min(c.top_k, visible);
      const double kth = sorted[take - 1];
      const double slack = kScoreTolerance * std::max(1.0, std::abs(sorted[0]));
      std::vector<std::int32_t> row(got.begin() + t * c.top_k, got.begin() + (t + 1) * c.top_k);
      for (std::int64_t j = 0; j < c.top_k; ++j) {
        if (j >= take) {
          EXPECT_EQ(row[j], -1) << "t=" << t << " j=" << j;
          continue;
        }
        ASSERT_GE(row[j], 0) << "t=" << t << " j=" << j;
        ASSERT_LT(row[j], visible) << "t=" << t << " j=" << j;
        EXPECT_GE(scores[row[j]], kth - slack) << "t=" << t << " j=" << j;
        // Ascending key order, each key once.
        if (j > 0) {
          EXPECT_LT(row[j - 1], row[j]) << "t=" << t << " j=" << j;
        }
      }
    }
  }
}

TEST(CudaIndexerTopK, RejectsMoreSurvivorsThanSharedMemoryHolds) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Tensor q = AllocateOrFail(cuda, DType::kF32, {2, 1, 4});
  Tensor k = AllocateOrFail(cuda, DType::kF32, {16386, 4});
  Tensor w = AllocateOrFail(cuda, DType::kF32, {2, 1});
  Tensor selected = AllocateOrFail(cuda, DType::kI32, {2, 16385});
  EXPECT_THAT(cuda.IndexerTopK(q, k, w, 16384, selected),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("IndexerTopK: top_k 16385 of 16386 visible keys; the CUDA "
                                 "selection holds at most 16384 selected keys per query")));
}

TEST(CudaIndexerTopK, RejectsMoreHeadsThanABlockHolds) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Tensor q = AllocateOrFail(cuda, DType::kF32, {1, 129, 8});
  Tensor k = AllocateOrFail(cuda, DType::kF32, {16, 8});
  Tensor w = AllocateOrFail(cuda, DType::kF32, {1, 129});
  Tensor selected = AllocateOrFail(cuda, DType::kI32, {1, 4});
  EXPECT_THAT(cuda.IndexerTopK(q, k, w, 15, selected),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("IndexerTopK: 129 indexer heads; the CUDA scoring kernel holds "
                                 "at most 128 (query, head) rows per block")));
}

}  // namespace
}  // namespace nq::kernels
