// Backend::PrefetchMatMulWeights on the CPU: a hint that changes nothing (the CPU has no cache to
// fill), runs on the side, and refuses what is not a MatMul weight before doing anything.
#include <cstdint>
#include <memory>
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
using ::testing::HasSubstr;

TEST(PrefetchMatMulWeights, ChangesNoResultAndRunsOnTheSide) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4401);
  Tensor x = Upload(*cpu, RandomUniform(rng, 2 * 70, -1.0f, 1.0f), DType::kF32, {2, 70});
  Tensor w = Upload(*cpu, RandomUniform(rng, 33 * 70, -1.0f, 1.0f), DType::kBF16, {33, 70});
  Tensor before = AllocateOrFail(*cpu, DType::kF32, {2, 33});
  NQ_ASSERT_OK(cpu->MatMul(x, w, before));
  ASSERT_TRUE(cpu->BeginSideWork().ok());
  for (std::int64_t bytes : {std::int64_t{0}, std::int64_t{1}, std::int64_t{4096}, std::int64_t{1} << 40}) {
    NQ_ASSERT_OK(cpu->PrefetchMatMulWeights({&w}, bytes));
    NQ_ASSERT_OK(cpu->PrefetchMatMulWeights({&w}, bytes, /*keep=*/true));
  }
  ASSERT_TRUE(cpu->EndSideWork().ok());
  Tensor after = AllocateOrFail(*cpu, DType::kF32, {2, 33});
  NQ_ASSERT_OK(cpu->MatMul(x, w, after));
  ASSERT_TRUE(cpu->JoinSideWork().ok());
  EXPECT_EQ(Download(*cpu, after), Download(*cpu, before));
}

TEST(PrefetchMatMulWeights, RefusesWhatIsNotAMatMulWeight) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor w = AllocateOrFail(*cpu, DType::kBF16, {4, 8});
  EXPECT_THAT(cpu->PrefetchMatMulWeights({nullptr}, 16), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(cpu->PrefetchMatMulWeights({&w}, -1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("< 0")));
  Tensor rank3 = AllocateOrFail(*cpu, DType::kBF16, {2, 4, 8});
  EXPECT_THAT(cpu->PrefetchMatMulWeights({&rank3}, 16), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must have rank 2")));
  Tensor ids = AllocateOrFail(*cpu, DType::kI32, {4, 8});
  EXPECT_THAT(cpu->PrefetchMatMulWeights({&ids}, 16), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be")));
  Tensor foreign = AllocateOrFail(*other, DType::kBF16, {4, 8});
  EXPECT_THAT(cpu->PrefetchMatMulWeights({&foreign}, 16), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("another backend")));
  Tensor empty;
  EXPECT_THAT(cpu->PrefetchMatMulWeights({&empty}, 16), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty tensor")));
}

}  // namespace
}  // namespace nq::kernels
