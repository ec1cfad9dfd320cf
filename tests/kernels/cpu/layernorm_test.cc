// CPU LayerNorm against a naive double-precision reference, and its argument errors.
#include <cstdint>
#include <limits>
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
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::RefLayerNorm;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

constexpr double kTolerance = 1e-6;
constexpr float kEps = 1e-6f;

TEST(CpuLayerNorm, MatchesDoubleReferenceOnRandomShapes) {
  std::mt19937_64 rng = MakeRng(2401);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // 128: the DSA indexer's key norm; 600 x 2048 crosses the threading threshold.
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {
      {1, 1}, {3, 5}, {7, 128}, {4, 1536}, {600, 2048}};
  for (int i = 0; i < 4; ++i) cases.emplace_back(RandomInt(rng, 1, 33), RandomInt(rng, 1, 2000));
  for (const auto& [rows, cols] : cases) {
    SCOPED_TRACE(absl::StrCat("rows=", rows, " cols=", cols));
    // A large common offset makes the two-pass variance matter.
    std::vector<float> x = RandomNormal(rng, rows * cols, 2.0f);
    for (float& v : x) v += 100.0f;
    const std::vector<float> w = RandomUniform(rng, cols, 0.5f, 1.5f);
    const std::vector<float> b = RandomNormal(rng, cols, 0.5f);
    Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
    Tensor tw = Upload(*backend, w, DType::kF32, {cols});
    Tensor tb = Upload(*backend, b, DType::kF32, {cols});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
    NQ_ASSERT_OK(backend->LayerNorm(tx, tw, tb, kEps, ty));
    EXPECT_LT(NormalizedError(Download(*backend, ty), RefLayerNorm(x, w, b, rows, cols, kEps)),
              kTolerance);
  }
}

TEST(CpuLayerNorm, RunsInPlaceOnThreeDimensionalInput) {
  std::mt19937_64 rng = MakeRng(2402);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<float> x = RandomNormal(rng, 2 * 3 * 64, 1.0f);
  const std::vector<float> w = RandomUniform(rng, 64, 0.5f, 1.5f);
  const std::vector<float> b = RandomNormal(rng, 64, 1.0f);
  Tensor tx = Upload(*backend, x, DType::kF32, {2, 3, 64});
  Tensor tw = Upload(*backend, w, DType::kF32, {64});
  Tensor tb = Upload(*backend, b, DType::kF32, {64});
  NQ_ASSERT_OK(backend->LayerNorm(tx, tw, tb, kEps, tx));
  EXPECT_LT(NormalizedError(Download(*backend, tx), RefLayerNorm(x, w, b, 6, 64, kEps)),
            kTolerance);
}

TEST(CpuLayerNorm, ConstantRowGivesTheBias) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = Upload(*backend, std::vector<float>(4, 3.0f), DType::kF32, {1, 4});
  Tensor tw = Upload(*backend, std::vector<float>(4, 2.0f), DType::kF32, {4});
  Tensor tb = Upload(*backend, std::vector<float>{1, 2, 3, 4}, DType::kF32, {4});
  NQ_ASSERT_OK(backend->LayerNorm(tx, tw, tb, kEps, tx));
  EXPECT_THAT(Download(*backend, tx), ::testing::ElementsAre(1.0f, 2.0f, 3.0f, 4.0f));
}

class CpuLayerNormErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  Tensor w_ = AllocateOrFail(*backend_, DType::kF32, {8});
  Tensor b_ = AllocateOrFail(*backend_, DType::kF32, {8});
  Tensor y_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
};

TEST_F(CpuLayerNormErrors, RejectsWeightOrBiasOfWrongLength) {
  Tensor short_bias = AllocateOrFail(*backend_, DType::kF32, {7});
  EXPECT_THAT(backend_->LayerNorm(x_, w_, short_bias, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("LayerNorm: bias F32[7] does not match the last dim of x "
                                 "F32[2, 8]")));
  Tensor matrix = AllocateOrFail(*backend_, DType::kF32, {1, 8});
  EXPECT_THAT(backend_->LayerNorm(x_, matrix, b_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("LayerNorm: weight must have rank 1, got F32[1, 8]")));
}

TEST_F(CpuLayerNormErrors, RejectsNonF32WeightAndBadEps) {
  Tensor bf16 = AllocateOrFail(*backend_, DType::kBF16, {8});
  EXPECT_THAT(backend_->LayerNorm(x_, bf16, b_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("LayerNorm: weight must be F32, got BF16[8]")));
  EXPECT_THAT(backend_->LayerNorm(x_, w_, b_, std::numeric_limits<float>::infinity(), y_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("LayerNorm: eps must be finite and >= 0")));
}

TEST_F(CpuLayerNormErrors, RejectsWrongOutputShape) {
  Tensor y = AllocateOrFail(*backend_, DType::kF32, {8, 2});
  EXPECT_THAT(backend_->LayerNorm(x_, w_, b_, kEps, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("LayerNorm: y is F32[8, 2], expected [2, 8] from x F32[2, 8]")));
}

}  // namespace
}  // namespace nq::kernels
