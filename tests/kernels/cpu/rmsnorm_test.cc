// CPU RmsNorm against a naive double-precision reference, and its argument errors.
#include <cstdint>
#include <limits>
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
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::RefRmsNorm;
using ::nq::kernels::testing::RoundTo;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

// Double accumulation, one fp32 rounding per multiply.
constexpr double kTolerance = 1e-6;
constexpr float kEps = 1e-6f;

TEST(CpuRmsNorm, MatchesDoubleReferenceOnRandomShapes) {
  std::mt19937_64 rng = MakeRng(201);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {{1, 1}, {3, 5}, {7, 513}, {4, 1536}};
  for (int i = 0; i < 4; ++i) cases.emplace_back(RandomInt(rng, 1, 33), RandomInt(rng, 1, 2000));
  for (DType w_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const auto& [rows, cols] : cases) {
      SCOPED_TRACE(absl::StrCat("weight ", DTypeName(w_dtype), " rows=", rows, " cols=", cols));
      const std::vector<float> x = RandomNormal(rng, rows * cols, 3.0f);
      const std::vector<float> w = RoundTo(w_dtype, RandomUniform(rng, cols, 0.5f, 1.5f));
      Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
      Tensor tw = Upload(*backend, w, w_dtype, {cols});
      Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
      NQ_ASSERT_OK(backend->RmsNorm(tx, tw, kEps, ty));
      EXPECT_LT(NormalizedError(Download(*backend, ty), RefRmsNorm(x, w, rows, cols, kEps)),
                kTolerance);
    }
  }
}

TEST(CpuRmsNorm, RunsInPlaceOnThreeDimensionalInput) {
  std::mt19937_64 rng = MakeRng(202);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<float> x = RandomNormal(rng, 2 * 3 * 64, 1.0f);
  const std::vector<float> w = RandomUniform(rng, 64, 0.5f, 1.5f);
  Tensor tx = Upload(*backend, x, DType::kF32, {2, 3, 64});
  Tensor tw = Upload(*backend, w, DType::kF32, {64});
  NQ_ASSERT_OK(backend->RmsNorm(tx, tw, kEps, tx));
  EXPECT_LT(NormalizedError(Download(*backend, tx), RefRmsNorm(x, w, 6, 64, kEps)), kTolerance);
}

TEST(CpuRmsNorm, ZeroRowGivesZerosWithPositiveEps) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = Upload(*backend, std::vector<float>(8, 0.0f), DType::kF32, {1, 8});
  Tensor tw = Upload(*backend, std::vector<float>(8, 1.0f), DType::kBF16, {8});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {1, 8});
  NQ_ASSERT_OK(backend->RmsNorm(tx, tw, kEps, ty));
  EXPECT_THAT(Download(*backend, ty), ::testing::Each(0.0f));
}

class CpuRmsNormErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  Tensor w_ = AllocateOrFail(*backend_, DType::kBF16, {8});
  Tensor y_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
};

TEST_F(CpuRmsNormErrors, RejectsWeightOfWrongLength) {
  Tensor w = AllocateOrFail(*backend_, DType::kBF16, {7});
  EXPECT_THAT(backend_->RmsNorm(x_, w, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("RmsNorm: weight BF16[7] does not match the last dim of x "
                                 "F32[2, 8]")));
}

TEST_F(CpuRmsNormErrors, RejectsWrongOutputShape) {
  Tensor y = AllocateOrFail(*backend_, DType::kF32, {8, 2});
  EXPECT_THAT(backend_->RmsNorm(x_, w_, kEps, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("RmsNorm: y is F32[8, 2], expected [2, 8]")));
}

TEST_F(CpuRmsNormErrors, RejectsBadEps) {
  EXPECT_THAT(backend_->RmsNorm(x_, w_, -1.0f, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eps must be finite")));
  EXPECT_THAT(backend_->RmsNorm(x_, w_, std::numeric_limits<float>::quiet_NaN(), y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eps must be finite")));
}

TEST_F(CpuRmsNormErrors, RejectsScalarInput) {
  Tensor x = AllocateOrFail(*backend_, DType::kF32, {});
  Tensor y = AllocateOrFail(*backend_, DType::kF32, {});
  EXPECT_THAT(backend_->RmsNorm(x, w_, kEps, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("RmsNorm: x must have rank at least 1, got F32[]")));
}

TEST_F(CpuRmsNormErrors, RejectsNonF32Input) {
  Tensor x = AllocateOrFail(*backend_, DType::kF16, {2, 8});
  EXPECT_THAT(backend_->RmsNorm(x, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("RmsNorm: x must be F32, got F16[2, 8]")));
}

}  // namespace
}  // namespace nq::kernels
