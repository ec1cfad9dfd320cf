// CPU Softmax against a naive double-precision reference (scales, masked rows), and its errors.
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
using ::nq::kernels::testing::RefSoftmax;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

constexpr double kTolerance = 1e-6;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

TEST(CpuSoftmax, MatchesDoubleReferenceOnRandomShapesAndScales) {
  std::mt19937_64 rng = MakeRng(401);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {{1, 1}, {4, 7}, {8, 129}, {2, 5000}};
  for (int i = 0; i < 4; ++i) cases.emplace_back(RandomInt(rng, 1, 20), RandomInt(rng, 1, 3000));
  for (float scale : {1.0f, 0.0721f, -2.0f}) {
    for (const auto& [rows, cols] : cases) {
      SCOPED_TRACE(absl::StrCat("scale=", scale, " rows=", rows, " cols=", cols));
      // Wide logits (sigma 10) make the max subtraction matter.
      const std::vector<float> x = RandomNormal(rng, rows * cols, 10.0f);
      Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
      Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
      NQ_ASSERT_OK(backend->Softmax(tx, scale, ty));
      EXPECT_LT(NormalizedError(Download(*backend, ty), RefSoftmax(x, rows, cols, scale)),
                kTolerance);
    }
  }
}

TEST(CpuSoftmax, MaskedEntriesGetZeroAndFullyMaskedRowsAreZero) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<float> x = {0.0f, kNegInf, 0.0f, kNegInf,   // half masked
                                kNegInf, kNegInf, kNegInf, kNegInf};  // fully masked
  Tensor tx = Upload(*backend, x, DType::kF32, {2, 4});
  NQ_ASSERT_OK(backend->Softmax(tx, 1.0f, tx));  // in place
  EXPECT_THAT(Download(*backend, tx),
              ::testing::ElementsAre(0.5f, 0.0f, 0.5f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
}

TEST(CpuSoftmax, LargeLogitsDoNotOverflow) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = Upload(*backend, std::vector<float>{1000.0f, 1000.0f}, DType::kF32, {1, 2});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {1, 2});
  NQ_ASSERT_OK(backend->Softmax(tx, 1.0f, ty));
  EXPECT_THAT(Download(*backend, ty), ::testing::ElementsAre(0.5f, 0.5f));
}

TEST(CpuSoftmax, RejectsNonFiniteScale) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = AllocateOrFail(*backend, DType::kF32, {2, 4});
  EXPECT_THAT(backend->Softmax(tx, std::numeric_limits<float>::infinity(), tx),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Softmax: scale must be finite")));
}

TEST(CpuSoftmax, RejectsWrongOutputShapeAndDType) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = AllocateOrFail(*backend, DType::kF32, {2, 4});
  Tensor wrong_shape = AllocateOrFail(*backend, DType::kF32, {2, 5});
  EXPECT_THAT(backend->Softmax(tx, 1.0f, wrong_shape),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Softmax: y is F32[2, 5], expected [2, 4]")));
  Tensor wrong_dtype = AllocateOrFail(*backend, DType::kBF16, {2, 4});
  EXPECT_THAT(backend->Softmax(tx, 1.0f, wrong_dtype),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Softmax: y must be F32, got BF16[2, 4]")));
}

}  // namespace
}  // namespace nq::kernels
