// CPU Add (residual connections), in and out of place, and its argument errors.
#include <cstdint>
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
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

std::vector<float> Sum(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

TEST(CpuAdd, AddsElementwiseIntoAThirdTensorAndInPlace) {
  std::mt19937_64 rng = MakeRng(2201);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // 3 x 5 x 7: not a multiple of the chunk alignment; 1 x 2^20 + 3: takes both threads.
  for (const Shape& shape : {Shape{3, 5, 7}, Shape{1, (1 << 20) + 3}}) {
    SCOPED_TRACE(shape.ToString());
    const std::vector<float> a = RandomNormal(rng, shape.NumElements(), 1.0f);
    const std::vector<float> b = RandomNormal(rng, shape.NumElements(), 1.0f);
    const std::vector<float> want = Sum(a, b);
    Tensor ta = Upload(*backend, a, DType::kF32, shape);
    Tensor tb = Upload(*backend, b, DType::kF32, shape);
    Tensor out = AllocateOrFail(*backend, DType::kF32, shape);
    NQ_ASSERT_OK(backend->Add(ta, tb, out));
    EXPECT_EQ(Download(*backend, out), want);
    NQ_ASSERT_OK(backend->Add(ta, tb, tb));  // out = b
    EXPECT_EQ(Download(*backend, tb), want);
    NQ_ASSERT_OK(backend->Add(ta, ta, ta));  // out = a = b
    EXPECT_EQ(Download(*backend, ta), Sum(a, a));
  }
}

TEST(CpuAdd, RejectsMismatchedShapesAndDTypes) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor a = AllocateOrFail(*backend, DType::kF32, {2, 4});
  Tensor b = AllocateOrFail(*backend, DType::kF32, {4, 2});
  Tensor out = AllocateOrFail(*backend, DType::kF32, {2, 4});
  EXPECT_THAT(backend->Add(a, b, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Add: b is F32[4, 2], expected [2, 4] from a F32[2, 4]")));
  EXPECT_THAT(backend->Add(a, a, b),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Add: out is F32[4, 2], expected [2, 4] from a F32[2, 4]")));
  Tensor half = AllocateOrFail(*backend, DType::kBF16, {2, 4});
  EXPECT_THAT(backend->Add(a, half, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Add: b must be F32, got BF16[2, 4]")));
  EXPECT_THAT(backend->Add(a, Tensor(), out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Add: b is an empty tensor")));
}

}  // namespace
}  // namespace nq::kernels
