// CPU RmsNorm against a naive double-precision reference, and its argument errors; AddRmsNorm
// (the CPU's default: the Adds, then the RmsNorm): x keeps the residual sum, y its norm, bit for
// bit what Add and RmsNorm give one after another, and the arguments it refuses.
#include <cstdint>
#include <limits>
#include <utility>
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

// ---- AddRmsNorm ----

// What the fused op replaces: x += d0 (+ d1, summed first), y = RmsNorm(x).
struct Unfused {
  std::vector<float> x, y;
};
void RunUnfused(Backend& backend, const std::vector<float>& x, const std::vector<std::vector<float>>& deltas,
                const std::vector<float>& w, std::int64_t rows, std::int64_t cols, Unfused& out) {
  Tensor tx = Upload(backend, x, DType::kF32, {rows, cols});
  Tensor sum = Upload(backend, deltas[0], DType::kF32, {rows, cols});
  if (deltas.size() > 1) {
    Tensor d1 = Upload(backend, deltas[1], DType::kF32, {rows, cols});
    NQ_ASSERT_OK(backend.Add(sum, d1, sum));
  }
  NQ_ASSERT_OK(backend.Add(tx, sum, tx));
  Tensor tw = Upload(backend, w, DType::kBF16, {cols});
  Tensor ty = AllocateOrFail(backend, DType::kF32, {rows, cols});
  NQ_ASSERT_OK(backend.RmsNorm(tx, tw, kEps, ty));
  out = {Download(backend, tx), Download(backend, ty)};
}

TEST(CpuAddRmsNorm, EqualsTheAddsThenTheNormBitForBit) {
  std::mt19937_64 rng = MakeRng(2101);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 6144}, {4, 7168}, {3, 13}}) {
    for (int count : {1, 2}) {
      SCOPED_TRACE(absl::StrCat("rows=", rows, " cols=", cols, " deltas=", count));
      const std::vector<float> x = RandomNormal(rng, rows * cols, 3.0f);
      std::vector<std::vector<float>> deltas;
      for (int i = 0; i < count; ++i) deltas.push_back(RandomNormal(rng, rows * cols, 1.0f));
      const std::vector<float> w = RandomUniform(rng, cols, 0.5f, 1.5f);
      Unfused want;
      RunUnfused(*backend, x, deltas, w, rows, cols, want);

      Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
      std::vector<Tensor> td;
      for (const std::vector<float>& d : deltas) td.push_back(Upload(*backend, d, DType::kF32, {rows, cols}));
      std::vector<const Tensor*> refs;
      for (const Tensor& t : td) refs.push_back(&t);
      Tensor tw = Upload(*backend, w, DType::kBF16, {cols});
      Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
      NQ_ASSERT_OK(backend->AddRmsNorm(tx, refs, tw, kEps, ty));
      EXPECT_EQ(Download(*backend, tx), want.x);
      EXPECT_EQ(Download(*backend, ty), want.y);
      // The deltas are read, not written.
      for (int i = 0; i < count; ++i) EXPECT_EQ(Download(*backend, td[i]), deltas[i]);

      // In place: x ends as the norm of the sum.
      Tensor tx2 = Upload(*backend, x, DType::kF32, {rows, cols});
      NQ_ASSERT_OK(backend->AddRmsNorm(tx2, refs, tw, kEps, tx2));
      EXPECT_EQ(Download(*backend, tx2), want.y);
    }
  }
}

class CpuAddRmsNormErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  Tensor d_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  Tensor w_ = AllocateOrFail(*backend_, DType::kBF16, {8});
  Tensor y_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
};

TEST_F(CpuAddRmsNormErrors, RefusesNoneOrThreeDeltas) {
  EXPECT_THAT(backend_->AddRmsNorm(x_, {}, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("AddRmsNorm: one or two deltas, got 0")));
  const Tensor* three[] = {&d_, &d_, &d_};
  EXPECT_THAT(backend_->AddRmsNorm(x_, three, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one or two deltas, got 3")));
  const Tensor* null[] = {nullptr};
  EXPECT_THAT(backend_->AddRmsNorm(x_, null, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deltas[0] is null")));
}

TEST_F(CpuAddRmsNormErrors, RefusesADeltaThatIsXOrY) {
  const Tensor* x_as_delta[] = {&x_};
  EXPECT_THAT(backend_->AddRmsNorm(x_, x_as_delta, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x must not be the same tensor as deltas[0]")));
  const Tensor* y_as_delta[] = {&d_, &y_};
  EXPECT_THAT(backend_->AddRmsNorm(x_, y_as_delta, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("y must not be the same tensor as deltas[1]")));
}

TEST_F(CpuAddRmsNormErrors, RefusesMismatchedShapesAndTypes) {
  Tensor d = AllocateOrFail(*backend_, DType::kF32, {8, 2});
  const Tensor* wrong_shape[] = {&d};
  EXPECT_THAT(backend_->AddRmsNorm(x_, wrong_shape, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("AddRmsNorm: deltas[0] is F32[8, 2], expected [2, 8]")));
  Tensor d16 = AllocateOrFail(*backend_, DType::kF16, {2, 8});
  const Tensor* wrong_type[] = {&d16};
  EXPECT_THAT(backend_->AddRmsNorm(x_, wrong_type, w_, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deltas[0] must be F32")));
  const Tensor* ok[] = {&d_};
  Tensor w = AllocateOrFail(*backend_, DType::kBF16, {7});
  EXPECT_THAT(backend_->AddRmsNorm(x_, ok, w, kEps, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not match the last dim of x")));
  Tensor y = AllocateOrFail(*backend_, DType::kF32, {8, 2});
  EXPECT_THAT(backend_->AddRmsNorm(x_, ok, w_, kEps, y),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("y is F32[8, 2], expected [2, 8]")));
  EXPECT_THAT(backend_->AddRmsNorm(x_, ok, w_, -1.0f, y_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eps must be finite")));
}

}  // namespace
}  // namespace nq::kernels
