// CUDA IndexerTopK vs the CPU backend. With small-integer inputs every score is exact in fp32, so
// the selections (ties included) must be identical; with random normal inputs the CUDA fp32
// scores may reorder near-ties, so each selected key is checked against the CPU's k-th best
// double score instead. Also: chunked scoring of a long prefill, and the key-count limit.
#include <algorithm>
#include <cstdint>
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

std::vector<float> SmallInts(std::mt19937_64& rng, std::size_t count, int lo, int hi) {
  std::vector<float> out(count);
  for (float& v : out) v = static_cast<float>(RandomInt(rng, lo, hi));
  return out;
}

std::vector<std::int32_t> Select(Backend& backend, const Case& c, const std::vector<float>& q,
                                 const std::vector<float>& k, const std::vector<float>& w) {
  return RunIndexerTopK(backend, q, k, w, c.tokens, c.heads, c.dim, c.keys, c.start_pos, c.top_k);
}

TEST(CudaIndexerTopK, IntegerScoresSelectExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3701);
  // DSA: 64 indexer heads of 128, top_k 2048. The 300-token chunk at start_pos 15800 needs more
  // than the backend's 16 MiB of scores (260 rows of 16100 keys): it is scored in two chunks.
  std::vector<Case> cases = {{1, 1, 1, 1, 0, 1},
                             {7, 3, 5, 7, 0, 4},
                             {1, 64, 128, 5000, 4999, 2048},
                             {300, 8, 32, 300, 0, 64},
                             {300, 2, 8, 16100, 15800, 16},
                             {2, 4, 16, 16384, 16382, 3000}};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t tokens = RandomInt(rng, 1, 50);
    const std::int64_t start = RandomInt(rng, 0, 3000);
    cases.push_back({tokens, RandomInt(rng, 1, 16), RandomInt(rng, 1, 64), start + tokens, start,
                     RandomInt(rng, 1, 600)});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("T=", c.tokens, " Hi=", c.heads, " d=", c.dim, " S=", c.keys,
                              " start=", c.start_pos, " top_k=", c.top_k));
    // q, k in {-1, 0, 1}, weights in {1, 2}: |score| <= 2 * heads * dim, exact in fp32.
    const std::vector<float> q = SmallInts(rng, c.tokens * c.heads * c.dim, -1, 1);
    const std::vector<float> k = SmallInts(rng, c.keys * c.dim, -1, 1);
    const std::vector<float> w = SmallInts(rng, c.tokens * c.heads, 1, 2);
    EXPECT_TRUE(Select(*Backends().cuda, c, q, k, w) == Select(*Backends().cpu, c, q, k, w));
  }
}

// Small enough for compute-sanitizer's racecheck: several sort stages per thread, padding, -1s.
TEST(CudaIndexerTopK, TinyIntegerCasesSelectExactlyLikeCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3703);
  for (const Case& c : {Case{3, 2, 8, 40, 37, 8}, Case{5, 3, 4, 2100, 2095, 50}}) {
    SCOPED_TRACE(absl::StrCat("T=", c.tokens, " S=", c.keys, " top_k=", c.top_k));
    const std::vector<float> q = SmallInts(rng, c.tokens * c.heads * c.dim, -1, 1);
    const std::vector<float> k = SmallInts(rng, c.keys * c.dim, -1, 1);
    const std::vector<float> w = SmallInts(rng, c.tokens * c.heads, 1, 2);
    EXPECT_TRUE(Select(*Backends().cuda, c, q, k, w) == Select(*Backends().cpu, c, q, k, w));
  }
}

TEST(CudaIndexerTopK, RandomScoresSelectAValidTopK) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3702);
  const std::vector<Case> cases = {{1, 64, 128, 4096, 4095, 2048}, {64, 16, 64, 600, 500, 100}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("T=", c.tokens, " S=", c.keys, " top_k=", c.top_k));
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
      const double slack = 1e-5 * std::max(1.0, std::abs(sorted[0]));
      std::vector<std::int32_t> row(got.begin() + t * c.top_k, got.begin() + (t + 1) * c.top_k);
      for (std::int64_t j = 0; j < c.top_k; ++j) {
        if (j >= take) {
          EXPECT_EQ(row[j], -1) << "t=" << t << " j=" << j;
          continue;
        }
        ASSERT_GE(row[j], 0) << "t=" << t << " j=" << j;
        ASSERT_LT(row[j], visible) << "t=" << t << " j=" << j;
        EXPECT_GE(scores[row[j]], kth - slack) << "t=" << t << " j=" << j;
      }
      std::sort(row.begin(), row.begin() + take);
      EXPECT_TRUE(std::adjacent_find(row.begin(), row.begin() + take) == row.begin() + take)
          << "duplicate key for t=" << t;
    }
  }
}

TEST(CudaIndexerTopK, RejectsMoreVisibleKeysThanTheSortHolds) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Tensor q = AllocateOrFail(cuda, DType::kF32, {2, 1, 4});
  Tensor k = AllocateOrFail(cuda, DType::kF32, {16386, 4});
  Tensor w = AllocateOrFail(cuda, DType::kF32, {2, 1});
  Tensor selected = AllocateOrFail(cuda, DType::kI32, {2, 8});
  EXPECT_THAT(cuda.IndexerTopK(q, k, w, 16384, selected),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("IndexerTopK: 16386 visible keys (start_pos + tokens); the CUDA "
                                 "top-k sorts at most 16384 keys per query")));
}

}  // namespace
}  // namespace nq::kernels
