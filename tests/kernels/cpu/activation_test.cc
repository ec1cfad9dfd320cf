// CPU SiluAndMul against a naive double-precision reference, and its argument errors.
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
using ::nq::kernels::testing::RefSiluAndMul;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

constexpr double kTolerance = 1e-6;

TEST(CpuSiluAndMul, MatchesDoubleReferenceOnRandomShapes) {
  std::mt19937_64 rng = MakeRng(301);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {{1, 1}, {3, 5}, {8, 256}, {5, 1001}};
  for (int i = 0; i < 4; ++i) cases.emplace_back(RandomInt(rng, 1, 40), RandomInt(rng, 1, 3000));
  for (const auto& [rows, d] : cases) {
    SCOPED_TRACE(absl::StrCat("rows=", rows, " d=", d));
    // Gates over [-12, 12] reach both tails of the sigmoid.
    const std::vector<float> x = RandomUniform(rng, rows * 2 * d, -12.0f, 12.0f);
    Tensor tx = Upload(*backend, x, DType::kF32, {rows, 2 * d});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, d});
    NQ_ASSERT_OK(backend->SiluAndMul(tx, ty));
    EXPECT_LT(NormalizedError(Download(*backend, ty), RefSiluAndMul(x, rows, d)), kTolerance);
  }
}

TEST(CpuSiluAndMul, TakesGateFromTheFirstHalf) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // gate = [0, 100], up = [5, 2]: silu(0) * 5 = 0 and silu(100) * 2 = 200.
  Tensor tx = Upload(*backend, std::vector<float>{0.0f, 100.0f, 5.0f, 2.0f}, DType::kF32, {1, 4});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {1, 2});
  NQ_ASSERT_OK(backend->SiluAndMul(tx, ty));
  EXPECT_THAT(Download(*backend, ty), ::testing::ElementsAre(0.0f, 200.0f));
}

TEST(CpuSiluAndMul, RejectsOddLastDimension) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = AllocateOrFail(*backend, DType::kF32, {2, 7});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {2, 3});
  EXPECT_THAT(backend->SiluAndMul(tx, ty),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SiluAndMul: the last dim of x F32[2, 7] must be even")));
}

TEST(CpuSiluAndMul, RejectsWrongOutputShape) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor tx = AllocateOrFail(*backend, DType::kF32, {2, 8});
  Tensor ty = AllocateOrFail(*backend, DType::kF32, {2, 8});
  EXPECT_THAT(backend->SiluAndMul(tx, ty),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SiluAndMul: y is F32[2, 8], expected [2, 4] from x F32[2, 8]")));
}

}  // namespace
}  // namespace nq::kernels
