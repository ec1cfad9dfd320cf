// CPU IndexerTopK against a repeated-argmax reference in double: causal visibility, ties to the
// lower key, -1 padding, decode calls at start_pos > 0; and its argument errors.
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::RefIndexerTopK;
using ::nq::kernels::testing::RunIndexerTopK;
using ::nq::kernels::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Case {
  std::int64_t tokens, heads, dim, keys, start_pos, top_k;
};

// Small integers: every score is exact in float and double, so ties are real ties.
std::vector<float> RandomSmallInts(std::mt19937_64& rng, std::size_t count, int lo, int hi) {
  std::vector<float> out(count);
  for (float& v : out) v = static_cast<float>(RandomInt(rng, lo, hi));
  return out;
}

TEST(CpuIndexerTopK, MatchesReferenceOnRandomInputs) {
  std::mt19937_64 rng = MakeRng(2701);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // Decode-like rows late in a 100-key cache; a top_k larger than every visible set.
  std::vector<Case> cases = {
      {1, 1, 1, 1, 0, 1}, {5, 4, 8, 5, 0, 3}, {8, 16, 32, 100, 92, 8}, {6, 2, 16, 20, 3, 40}};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t tokens = RandomInt(rng, 1, 10);
    const std::int64_t start = RandomInt(rng, 0, 50);
    cases.push_back({tokens, RandomInt(rng, 1, 8), RandomInt(rng, 1, 40),
                     start + tokens + RandomInt(rng, 0, 5), start, RandomInt(rng, 1, 30)});
  }
  for (bool integers : {false, true}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat("integers=", integers, " T=", c.tokens, " Hi=", c.heads, " d=",
                                c.dim, " S=", c.keys, " start=", c.start_pos, " top_k=", c.top_k));
      const std::vector<float> q = integers
                                       ? RandomSmallInts(rng, c.tokens * c.heads * c.dim, -1, 1)
                                       : RandomNormal(rng, c.tokens * c.heads * c.dim, 1.0f);
      const std::vector<float> k = integers ? RandomSmallInts(rng, c.keys * c.dim, -1, 1)
                                            : RandomNormal(rng, c.keys * c.dim, 1.0f);
      const std::vector<float> w = integers ? RandomSmallInts(rng, c.tokens * c.heads, 1, 2)
                                            : RandomUniform(rng, c.tokens * c.heads, 0.0f, 1.0f);
      EXPECT_EQ(
          RunIndexerTopK(*backend, q, k, w, c.tokens, c.heads, c.dim, c.keys, c.start_pos, c.top_k),
          RefIndexerTopK(q, k, w, c.tokens, c.heads, c.dim, c.start_pos, c.top_k));
    }
  }
}

TEST(CpuIndexerTopK, ReluDropsNegativeDotsAndTiesGoToTheLowerKey) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // One head, weight 1, q = [1]: scores over keys 0..4 are [0, 2, 0, 3, 2].
  const std::vector<float> q = {1.0f};
  const std::vector<float> k = {-5.0f, 2.0f, -1.0f, 3.0f, 2.0f};
  const std::vector<float> w = {1.0f};
  // The selected keys come in ascending key order.
  EXPECT_THAT(RunIndexerTopK(*backend, q, k, w, 1, 1, 1, 5, 4, 2), ElementsAre(1, 3));
  EXPECT_THAT(RunIndexerTopK(*backend, q, k, w, 1, 1, 1, 5, 4, 4), ElementsAre(0, 1, 3, 4));
  EXPECT_THAT(RunIndexerTopK(*backend, q, k, w, 1, 1, 1, 5, 4, 5), ElementsAre(0, 1, 2, 3, 4));
  // A zero query ties every key at 0: the lowest keys win.
  EXPECT_THAT(RunIndexerTopK(*backend, std::vector<float>{0.0f}, k, w, 1, 1, 1, 5, 4, 3),
              ElementsAre(0, 1, 2));
}

TEST(CpuIndexerTopK, PadsWithMinusOneWhileFewerKeysThanTopKAreVisible) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // Three queries at positions 0, 1, 2 with top_k 4: 1, 2 and 3 visible keys.
  const std::vector<float> q = {1.0f, 1.0f, 1.0f};
  const std::vector<float> k = {1.0f, 3.0f, 2.0f};
  const std::vector<float> w = {1.0f, 1.0f, 1.0f};
  const std::vector<std::int32_t> got = RunIndexerTopK(*backend, q, k, w, 3, 1, 1, 3, 0, 4);
  EXPECT_THAT(got, ElementsAre(0, -1, -1, -1,  //
                               0, 1, -1, -1,   //
                               0, 1, 2, -1));
}

TEST(CpuIndexerTopK, DecodeCallsMatchTheRowsOfAPrefillCall) {
  std::mt19937_64 rng = MakeRng(2702);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  constexpr std::int64_t kTokens = 12, kHeads = 4, kDim = 16, kTopK = 5;
  const std::vector<float> q = RandomNormal(rng, kTokens * kHeads * kDim, 1.0f);
  const std::vector<float> k = RandomNormal(rng, kTokens * kDim, 1.0f);
  const std::vector<float> w = RandomUniform(rng, kTokens * kHeads, 0.0f, 1.0f);
  const std::vector<std::int32_t> prefill =
      RunIndexerTopK(*backend, q, k, w, kTokens, kHeads, kDim, kTokens, 0, kTopK);
  for (std::int64_t t = 0; t < kTokens; ++t) {
    const std::vector<float> q_t(q.begin() + t * kHeads * kDim,
                                 q.begin() + (t + 1) * kHeads * kDim);
    const std::vector<float> w_t(w.begin() + t * kHeads, w.begin() + (t + 1) * kHeads);
    EXPECT_EQ(
        RunIndexerTopK(*backend, q_t, k, w_t, 1, kHeads, kDim, kTokens, t, kTopK),
        std::vector<std::int32_t>(prefill.begin() + t * kTopK, prefill.begin() + (t + 1) * kTopK))
        << "t=" << t;
  }
}

class CpuIndexerTopKErrors : public ::testing::Test {
 protected:
  absl::Status Call(std::int64_t start_pos = 1) {
    return backend_->IndexerTopK(q_, k_, w_, start_pos, selected_);
  }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  // T = 3, Hi = 2, d = 4, S = 5, top_k = 2.
  Tensor q_ = AllocateOrFail(*backend_, DType::kF32, {3, 2, 4});
  Tensor k_ = AllocateOrFail(*backend_, DType::kF32, {5, 4});
  Tensor w_ = AllocateOrFail(*backend_, DType::kF32, {3, 2});
  Tensor selected_ = AllocateOrFail(*backend_, DType::kI32, {3, 2});
};

TEST_F(CpuIndexerTopKErrors, AcceptsTheBaseArguments) { NQ_EXPECT_OK(Call()); }

TEST_F(CpuIndexerTopKErrors, RejectsKeysOfAnotherHeadDim) {
  k_ = AllocateOrFail(*backend_, DType::kF32, {5, 3});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("IndexerTopK: k F32[5, 3] and q F32[3, 2, 4] disagree on "
                                         "the head dim (3 vs 4)")));
}

TEST_F(CpuIndexerTopKErrors, RejectsWeightsOfWrongShape) {
  w_ = AllocateOrFail(*backend_, DType::kF32, {3, 4});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("IndexerTopK: weights is F32[3, 4], expected [3, 2] from "
                                         "q F32[3, 2, 4]")));
}

TEST_F(CpuIndexerTopKErrors, RejectsBadSelectedTensor) {
  selected_ = AllocateOrFail(*backend_, DType::kF32, {3, 2});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("IndexerTopK: selected must be I32, got F32[3, 2]")));
  selected_ = AllocateOrFail(*backend_, DType::kI32, {3, 0});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("IndexerTopK: selected I32[3, 0] must be [3, top_k] with "
                                         "top_k >= 1")));
  selected_ = AllocateOrFail(*backend_, DType::kI32, {2, 2});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("selected I32[2, 2] must be [3, top_k]")));
}

TEST_F(CpuIndexerTopKErrors, RejectsPositionsPastTheKeys) {
  EXPECT_THAT(Call(3), StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("IndexerTopK: start_pos 3 + 3 tokens exceeds the 5 keys "
                                          "of k F32[5, 4]")));
  EXPECT_THAT(Call(-2), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("IndexerTopK: start_pos must be >= 0, got -2")));
}

}  // namespace
}  // namespace nq::kernels
