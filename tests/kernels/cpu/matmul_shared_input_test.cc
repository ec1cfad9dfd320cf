// Backend::MatMulSharedInput on the CPU: each output equals MatMul of its own matrix, and the
// argument errors (counts, shapes, aliasing) are refused before anything runs.
#include <cstdint>
#include <span>
#include <vector>

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
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::Each;
using WeightRef = Backend::WeightRef;
using ::testing::HasSubstr;

TEST(CpuMatMulSharedInput, EachOutputEqualsItsOwnMatMul) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(2201);
  constexpr std::int64_t kM = 3, kK = 70;
  const std::vector<std::int64_t> rows = {33, 1, 64, 7};
  const std::vector<DType> dtypes = {DType::kBF16, DType::kF32, DType::kBF16, DType::kF16};
  Tensor x = Upload(*backend, RandomUniform(rng, kM * kK, -1.0f, 1.0f), DType::kF32, {kM, kK});
  std::vector<Tensor> ws, ys;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    ws.push_back(Upload(*backend, RandomUniform(rng, rows[i] * kK, -1.0f, 1.0f), dtypes[i], {rows[i], kK}));
    ys.push_back(AllocateOrFail(*backend, DType::kF32, {kM, rows[i]}));
  }
  std::vector<WeightRef> w_ptrs;
  std::vector<Tensor*> y_ptrs;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    w_ptrs.push_back({&ws[i]});
    y_ptrs.push_back(&ys[i]);
  }
  NQ_ASSERT_OK(backend->MatMulSharedInput(x, w_ptrs, y_ptrs));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    Tensor alone = AllocateOrFail(*backend, DType::kF32, {kM, rows[i]});
    NQ_ASSERT_OK(backend->MatMul(x, ws[i], alone));
    EXPECT_EQ(Download(*backend, ys[i]), Download(*backend, alone)) << "matrix " << i;
  }
}

TEST(CpuMatMulSharedInput, EmptyInnerDimensionGivesZerosAndNoRowsIsNothing) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor x = AllocateOrFail(*backend, DType::kF32, {2, 0});
  Tensor w = AllocateOrFail(*backend, DType::kBF16, {3, 0});
  Tensor y = Upload(*backend, std::vector<float>(6, 5.0f), DType::kF32, {2, 3});
  Tensor none = AllocateOrFail(*backend, DType::kBF16, {0, 0});
  Tensor none_y = AllocateOrFail(*backend, DType::kF32, {2, 0});
  const WeightRef ws[] = {{&w}, {&none}};
  Tensor* ys[] = {&y, &none_y};
  NQ_ASSERT_OK(backend->MatMulSharedInput(x, ws, ys));
  EXPECT_THAT(Download(*backend, y), Each(0.0f));
}

class CpuMatMulSharedInputErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  Tensor a_ = AllocateOrFail(*backend_, DType::kBF16, {4, 8});
  Tensor b_ = AllocateOrFail(*backend_, DType::kBF16, {5, 8});
  Tensor ya_ = Upload(*backend_, std::vector<float>(8, 9.0f), DType::kF32, {2, 4});
  Tensor yb_ = Upload(*backend_, std::vector<float>(10, 9.0f), DType::kF32, {2, 5});
};

TEST_F(CpuMatMulSharedInputErrors, RejectsMismatchedOrEmptyLists) {
  const WeightRef ws[] = {{&a_}, {&b_}};
  Tensor* one_y[] = {&ya_};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, ws, one_y),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 weights and 1 outputs")));
  EXPECT_THAT(backend_->MatMulSharedInput(x_, {}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 weights and 0 outputs")));
  std::vector<WeightRef> many_w(Backend::kMaxSharedInputMatMuls + 1, WeightRef{&a_});
  std::vector<Tensor*> many_y(Backend::kMaxSharedInputMatMuls + 1, &ya_);
  EXPECT_THAT(backend_->MatMulSharedInput(x_, many_w, many_y),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("from 1 to 8")));
  const WeightRef null_w[] = {{&a_}, {nullptr}};
  Tensor* ys[] = {&ya_, &yb_};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, null_w, ys),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pair 1 has a null weight")));
}

TEST_F(CpuMatMulSharedInputErrors, RejectsBadShapesAndLeavesEveryOutputAlone) {
  Tensor wrong_k = AllocateOrFail(*backend_, DType::kBF16, {5, 9});
  const WeightRef ws[] = {{&a_}, {&wrong_k}};
  Tensor* ys[] = {&ya_, &yb_};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, ws, ys),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("disagree on k (8 vs 9)")));
  // Validation comes first: the valid first pair was not computed either.
  EXPECT_THAT(Download(*backend_, ya_), Each(9.0f));
  Tensor i32 = AllocateOrFail(*backend_, DType::kI32, {5, 8});
  const WeightRef with_i32[] = {{&a_}, {&i32}};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, with_i32, ys),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ws[1]")));
}

TEST_F(CpuMatMulSharedInputErrors, RefusesFp8WithoutItsScalesAndScalesOnOtherWeights) {
  Tensor fp8 = AllocateOrFail(*backend_, DType::kF8E4M3, {5, 8});
  Tensor scales = AllocateOrFail(*backend_, DType::kF32, {1, 1});
  Tensor wrong_scales = AllocateOrFail(*backend_, DType::kF32, {2, 1});
  Tensor* ys[] = {&ya_, &yb_};
  const WeightRef no_scales[] = {{&a_}, {&fp8}};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, no_scales, ys),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ws[1] F8_E4M3[5, 8] needs its block scales")));
  const WeightRef bad_shape[] = {{&a_}, {&fp8, &wrong_scales}};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, bad_shape, ys),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scale_inv")));
  const WeightRef scaled_bf16[] = {{&a_, &scales}, {&fp8, &scales}};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, scaled_bf16, ys),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only F8_E4M3 weights take them")));
}

TEST(CpuMatMulSharedInput, Fp8WeightsEqualTheirMatMulBlockScaled) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(2204);
  constexpr std::int64_t kM = 2, kK = 300, kN = 130;
  Tensor x = Upload(*backend, RandomUniform(rng, kM * kK, -1.0f, 1.0f), DType::kF32, {kM, kK});
  std::vector<std::uint8_t> codes(kN * kK);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>(rng() % 0x7e);  // finite
  Tensor fp8 = AllocateOrFail(*backend, DType::kF8E4M3, {kN, kK});
  NQ_ASSERT_OK(backend->CopyFromHost(std::as_bytes(std::span(codes)), fp8));
  Tensor scales = Upload(*backend, RandomUniform(rng, 2 * 3, 0.001f, 0.01f), DType::kF32, {2, 3});
  Tensor plain = Upload(*backend, RandomUniform(rng, 7 * kK, -1.0f, 1.0f), DType::kBF16, {7, kK});
  Tensor y_fp8 = AllocateOrFail(*backend, DType::kF32, {kM, kN});
  Tensor y_plain = AllocateOrFail(*backend, DType::kF32, {kM, 7});
  const WeightRef ws[] = {{&fp8, &scales}, {&plain}};
  Tensor* ys[] = {&y_fp8, &y_plain};
  NQ_ASSERT_OK(backend->MatMulSharedInput(x, ws, ys));
  Tensor alone = AllocateOrFail(*backend, DType::kF32, {kM, kN});
  NQ_ASSERT_OK(backend->MatMulBlockScaled(x, fp8, scales, alone));
  EXPECT_EQ(Download(*backend, y_fp8), Download(*backend, alone));
}

TEST_F(CpuMatMulSharedInputErrors, RejectsOutputsThatAliasEachOtherTheInputOrAWeight) {
  const WeightRef ws[] = {{&a_}, {&a_}};
  Tensor* same_y[] = {&ya_, &ya_};
  EXPECT_THAT(backend_->MatMulSharedInput(x_, ws, same_y),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ys[1] must not be the same tensor as ys[0]")));
  Tensor square_x = AllocateOrFail(*backend_, DType::kF32, {4, 4});
  Tensor square_w = AllocateOrFail(*backend_, DType::kF32, {4, 4});
  const WeightRef square_ws[] = {{&square_w}};
  Tensor* into_x[] = {&square_x};
  EXPECT_THAT(backend_->MatMulSharedInput(square_x, square_ws, into_x),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must not be the same tensor as x")));
  Tensor* into_w[] = {&square_w};
  EXPECT_THAT(backend_->MatMulSharedInput(square_x, square_ws, into_w),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("y must not be the same tensor as w")));
}

}  // namespace
}  // namespace nq::kernels
