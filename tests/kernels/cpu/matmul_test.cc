// CPU MatMul against a naive double-precision reference, and its argument errors.
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::RefMatMul;
using ::nq::kernels::testing::RoundTo;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

// fp32 accumulation over k <= ~600 terms of magnitude <= 1: a few ulps of the largest output.
constexpr double kTolerance = 1e-5;

struct Dims {
  std::int64_t m, n, k;
};

// Runs y = x · w^T on `backend` with fresh uniform inputs; returns the normalised error.
double RunAgainstReference(Backend& backend, std::mt19937_64& rng, const Dims& d, DType w_dtype) {
  const std::vector<float> x = RandomUniform(rng, d.m * d.k, -1.0f, 1.0f);
  const std::vector<float> w = RoundTo(w_dtype, RandomUniform(rng, d.n * d.k, -1.0f, 1.0f));
  Tensor tx = Upload(backend, x, DType::kF32, {d.m, d.k});
  Tensor tw = Upload(backend, w, w_dtype, {d.n, d.k});
  Tensor ty = AllocateOrFail(backend, DType::kF32, {d.m, d.n});
  const absl::Status status = backend.MatMul(tx, tw, ty);
  EXPECT_TRUE(status.ok()) << status;
  return NormalizedError(Download(backend, ty), RefMatMul(x, w, d.m, d.n, d.k));
}

TEST(CpuMatMul, MatchesDoubleReferenceOnRandomShapes) {
  std::mt19937_64 rng = MakeRng(101);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<Dims> cases = {{1, 1, 1},  {1, 7, 13},   {3, 5, 17},   {4, 64, 64},
                             {5, 33, 100}, {17, 31, 129}, {64, 48, 256}};
  for (int i = 0; i < 6; ++i) {
    cases.push_back({RandomInt(rng, 1, 40), RandomInt(rng, 1, 70), RandomInt(rng, 1, 300)});
  }
  for (DType w_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Dims& d : cases) {
      SCOPED_TRACE(absl::StrCat("w ", DTypeName(w_dtype), " m=", d.m, " n=", d.n, " k=", d.k));
      EXPECT_LT(RunAgainstReference(*backend, rng, d, w_dtype), kTolerance);
    }
  }
}

TEST(CpuMatMul, ThreadedProblemMatchesReference) {
  std::mt19937_64 rng = MakeRng(102);
  // Three threads over n = 515 columns: uneven chunks and a partial last tile.
  std::unique_ptr<Backend> backend = MakeCpuBackend(3);
  EXPECT_LT(RunAgainstReference(*backend, rng, {.m = 16, .n = 515, .k = 600}, DType::kBF16),
            kTolerance);
}

TEST(CpuMatMul, FoldsLeadingDimensionsOfX) {
  std::mt19937_64 rng = MakeRng(103);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<float> x = RandomUniform(rng, 2 * 3 * 8, -1.0f, 1.0f);
  const std::vector<float> w = RandomUniform(rng, 5 * 8, -1.0f, 1.0f);
  Tensor tx = Upload(*backend, x, DType::kF32, {2, 3, 8});
  Tensor tw = Upload(*backend, w, DType::kF32, {5, 8});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {2, 3, 5});
  NQ_ASSERT_OK(backend->MatMul(tx, tw, ty));
  EXPECT_LT(NormalizedError(Download(*backend, ty), RefMatMul(x, w, 6, 5, 8)), kTolerance);
}

TEST(CpuMatMul, EmptyInnerDimensionGivesZeros) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = AllocateOrFail(*backend, DType::kF32, {3, 0});
  Tensor tw = AllocateOrFail(*backend, DType::kBF16, {4, 0});
  Tensor ty = Upload(*backend, std::vector<float>(12, 7.0f), DType::kF32, {3, 4});
  NQ_ASSERT_OK(backend->MatMul(tx, tw, ty));
  EXPECT_THAT(Download(*backend, ty), ::testing::Each(0.0f));
}

class CpuMatMulErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  Tensor w_ = AllocateOrFail(*backend_, DType::kF32, {4, 8});
  Tensor y_ = AllocateOrFail(*backend_, DType::kF32, {2, 4});
};

TEST_F(CpuMatMulErrors, RejectsInnerDimensionMismatch) {
  Tensor w = AllocateOrFail(*backend_, DType::kBF16, {4, 9});
  EXPECT_THAT(backend_->MatMul(x_, w, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: x F32[2, 8] and w BF16[4, 9] disagree on k (8 vs 9)")));
}

TEST_F(CpuMatMulErrors, RejectsWrongOutputShape) {
  Tensor y = AllocateOrFail(*backend_, DType::kF32, {2, 5});
  EXPECT_THAT(backend_->MatMul(x_, w_, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("y is F32[2, 5], expected [2, 4] from x F32[2, 8] and w "
                                 "F32[4, 8]")));
}

TEST_F(CpuMatMulErrors, RejectsNonF32Activations) {
  Tensor x = AllocateOrFail(*backend_, DType::kBF16, {2, 8});
  EXPECT_THAT(backend_->MatMul(x, w_, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: x must be F32, got BF16[2, 8]")));
  Tensor y = AllocateOrFail(*backend_, DType::kF16, {2, 4});
  EXPECT_THAT(backend_->MatMul(x_, w_, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: y must be F32, got F16[2, 4]")));
}

TEST_F(CpuMatMulErrors, RejectsWeightsThatAreNotAMatrix) {
  Tensor w = AllocateOrFail(*backend_, DType::kF32, {8});
  EXPECT_THAT(backend_->MatMul(x_, w, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("w must have rank 2, got F32[8]")));
}

TEST_F(CpuMatMulErrors, RejectsTensorFromAnotherBackend) {
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor w = AllocateOrFail(*other, DType::kF32, {4, 8});
  EXPECT_THAT(backend_->MatMul(x_, w, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: w F32[4, 8] belongs to another backend")));
}

TEST_F(CpuMatMulErrors, RejectsEmptyTensor) {
  Tensor moved = std::move(w_);
  EXPECT_THAT(backend_->MatMul(x_, w_, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: w is an empty tensor")));
}

TEST_F(CpuMatMulErrors, RejectsOutputThatIsTheInput) {
  Tensor square_x = AllocateOrFail(*backend_, DType::kF32, {4, 4});
  Tensor square_w = AllocateOrFail(*backend_, DType::kF32, {4, 4});
  EXPECT_THAT(backend_->MatMul(square_x, square_w, square_x),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("y must not be the same tensor as x")));
}

}  // namespace
}  // namespace nq::kernels
