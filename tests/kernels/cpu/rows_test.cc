// CPU WriteRows / GatherRows / ScatterAddRows (KV-cache writes, MoE dispatch and combine),
// CopyRows (a step's last row feeding the next step), and their argument errors.
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
using ::nq::kernels::testing::DownloadI32;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

TEST(CpuWriteRows, WritesAtTheOffsetAndLeavesOtherRows) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  constexpr std::int64_t kRows = 6, kCols = 3;
  std::vector<float> cache(kRows * kCols);
  for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = -static_cast<float>(i);
  const std::vector<float> src = {1, 2, 3, 4, 5, 6};
  Tensor tdst = Upload(*backend, cache, DType::kF32, {kRows, kCols});
  Tensor tsrc = Upload(*backend, src, DType::kF32, {2, kCols});
  NQ_ASSERT_OK(backend->WriteRows(tsrc, tdst, 3));
  std::vector<float> want = cache;
  std::copy(src.begin(), src.end(), want.begin() + 3 * kCols);
  EXPECT_EQ(Download(*backend, tdst), want);
  // The last rows, and an empty write anywhere in range.
  NQ_ASSERT_OK(backend->WriteRows(tsrc, tdst, kRows - 2));
  Tensor empty = AllocateOrFail(*backend, DType::kF32, {0, kCols});
  NQ_EXPECT_OK(backend->WriteRows(empty, tdst, kRows));
}

TEST(CpuWriteRows, RejectsRowsThatDoNotFit) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor src = AllocateOrFail(*backend, DType::kF32, {3, 8});
  Tensor dst = AllocateOrFail(*backend, DType::kF32, {10, 8});
  EXPECT_THAT(backend->WriteRows(src, dst, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: rows [8, 8 + 3) of src F32[3, 8] do not fit in dst "
                                 "F32[10, 8]")));
  EXPECT_THAT(backend->WriteRows(src, dst, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
  Tensor narrow = AllocateOrFail(*backend, DType::kF32, {10, 7});
  EXPECT_THAT(backend->WriteRows(src, narrow, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: src F32[3, 8] and dst F32[10, 7] disagree on the row "
                                 "width (8 vs 7)")));
  EXPECT_THAT(backend->WriteRows(dst, dst, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("WriteRows: dst must not be the same tensor as src")));
}

TEST(CpuGatherRows, GathersRepeatedRowsInOrder) {
  std::mt19937_64 rng = MakeRng(2501);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  constexpr std::int64_t kTokens = 7, kCols = 33;
  const std::vector<float> x = RandomNormal(rng, kTokens * kCols, 1.0f);
  const std::vector<std::int32_t> rows = {6, 0, 3, 3, 1, 6};
  Tensor tx = Upload(*backend, x, DType::kF32, {kTokens, kCols});
  Tensor out = AllocateOrFail(*backend, DType::kF32, {6, kCols});
  NQ_ASSERT_OK(backend->GatherRows(tx, rows, out));
  std::vector<float> want;
  for (std::int32_t r : rows)
    want.insert(want.end(), x.begin() + r * kCols, x.begin() + (r + 1) * kCols);
  EXPECT_EQ(Download(*backend, out), want);
}

TEST(CpuGatherRows, RejectsRowsOutOfRangeAndWrongOutput) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor x = AllocateOrFail(*backend, DType::kF32, {4, 8});
  Tensor out = AllocateOrFail(*backend, DType::kF32, {2, 8});
  EXPECT_THAT(backend->GatherRows(x, std::vector<std::int32_t>{0, 4}, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GatherRows: rows[1] = 4 is out of range for x F32[4, 8] "
                                 "(4 rows)")));
  EXPECT_THAT(backend->GatherRows(x, std::vector<std::int32_t>{0, 1, 2}, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GatherRows: out is F32[2, 8], expected [3, 8] from 3 rows of x "
                                 "F32[4, 8]")));
  Tensor x3 = AllocateOrFail(*backend, DType::kF32, {2, 2, 8});
  EXPECT_THAT(backend->GatherRows(x3, std::vector<std::int32_t>{0, 1}, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GatherRows: x must have rank 2, got F32[2, 2, 8]")));
}

TEST(CpuScatterAddRows, AccumulatesWeightedRowsIncludingRepeats) {
  std::mt19937_64 rng = MakeRng(2502);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // 4096 x 512: large enough to split the columns over both threads.
  for (const auto& [n, tokens, cols] :
       {std::tuple<std::int64_t, std::int64_t, std::int64_t>{9, 4, 17}, {4096, 512, 512}}) {
    const std::vector<float> src = RandomNormal(rng, n * cols, 1.0f);
    const std::vector<float> base = RandomNormal(rng, tokens * cols, 1.0f);
    std::vector<std::int32_t> rows(n);
    std::vector<float> weights(n);
    for (std::int64_t i = 0; i < n; ++i) {
      rows[i] = static_cast<std::int32_t>(RandomInt(rng, 0, tokens - 1));
      weights[i] = static_cast<float>(RandomInt(rng, -100, 100)) / 37.0f;
    }
    std::vector<double> want(base.begin(), base.end());
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t c = 0; c < cols; ++c)
        want[rows[i] * cols + c] += double{weights[i]} * src[i * cols + c];
    }
    Tensor tsrc = Upload(*backend, src, DType::kF32, {n, cols});
    Tensor out = Upload(*backend, base, DType::kF32, {tokens, cols});
    NQ_ASSERT_OK(backend->ScatterAddRows(tsrc, rows, weights, out));
    EXPECT_LT(NormalizedError(Download(*backend, out), want), 1e-6) << "n=" << n;
  }
}

TEST(CpuScatterAddRows, RejectsMismatchedSpansAndRows) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor src = AllocateOrFail(*backend, DType::kF32, {3, 8});
  Tensor out = AllocateOrFail(*backend, DType::kF32, {5, 8});
  const std::vector<std::int32_t> rows = {0, 1, 2};
  const std::vector<float> weights = {1, 1, 1};
  EXPECT_THAT(backend->ScatterAddRows(src, std::vector<std::int32_t>{0, 1}, weights, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ScatterAddRows: 2 rows for src F32[3, 8] (3 rows)")));
  EXPECT_THAT(backend->ScatterAddRows(src, rows, std::vector<float>{1, 1, 1, 1}, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ScatterAddRows: 4 weights for src F32[3, 8] (3 rows)")));
  EXPECT_THAT(backend->ScatterAddRows(src, std::vector<std::int32_t>{0, 5, 1}, weights, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ScatterAddRows: rows[1] = 5 is out of range for out F32[5, 8] "
                                 "(5 rows)")));
  Tensor wide = AllocateOrFail(*backend, DType::kF32, {5, 9});
  EXPECT_THAT(backend->ScatterAddRows(src, rows, weights, wide),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("disagree on the row width (8 vs 9)")));
  EXPECT_THAT(backend->ScatterAddRows(src, rows, weights, src),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ScatterAddRows: out must not be the same tensor as src")));
}

TEST(CpuCopyRows, CopiesTheRowRangeAndLeavesTheRest) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // I32 [4] (ids) and F32 [3, 2, 2] (rows of two dimensions): any dtype, any row shape.
  Tensor ids = UploadI32(*backend, std::vector<std::int32_t>{7, 8, 9, 10}, {4});
  Tensor one = UploadI32(*backend, std::vector<std::int32_t>{-1}, {1});
  NQ_ASSERT_OK(backend->CopyRows(ids, 3, one, 0, 1));
  EXPECT_EQ(DownloadI32(*backend, one), std::vector<std::int32_t>{10});
  std::vector<float> a(12), b(12, -1.0f);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  Tensor src = Upload(*backend, a, DType::kF32, {3, 2, 2});
  Tensor dst = Upload(*backend, b, DType::kF32, {3, 2, 2});
  NQ_ASSERT_OK(backend->CopyRows(src, 0, dst, 1, 2));
  EXPECT_EQ(Download(*backend, dst), (std::vector<float>{-1, -1, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7}));
  // Within one tensor, ranges apart.
  NQ_ASSERT_OK(backend->CopyRows(src, 2, src, 0, 1));
  EXPECT_EQ(Download(*backend, src), (std::vector<float>{8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11}));
  NQ_EXPECT_OK(backend->CopyRows(src, 3, dst, 3, 0));
}

TEST(CpuCopyRows, RefusesRowsOutOfRangeOtherRowsAndOverlaps) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor src = AllocateOrFail(*backend, DType::kF32, {4, 8});
  Tensor dst = AllocateOrFail(*backend, DType::kF32, {2, 8});
  EXPECT_THAT(backend->CopyRows(src, 3, dst, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CopyRows: rows [3, 3 + 2) of F32[4, 8]")));
  EXPECT_THAT(backend->CopyRows(src, 0, dst, 1, 2), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CopyRows: rows")));
  EXPECT_THAT(backend->CopyRows(src, -1, dst, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CopyRows: rows")));
  Tensor narrow = AllocateOrFail(*backend, DType::kF32, {4, 7});
  EXPECT_THAT(backend->CopyRows(src, 0, narrow, 0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("differ in their rows")));
  Tensor ints = AllocateOrFail(*backend, DType::kI32, {4, 8});
  EXPECT_THAT(backend->CopyRows(src, 0, ints, 0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("differ in their rows")));
  EXPECT_THAT(backend->CopyRows(src, 0, src, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of one tensor overlap")));
}

}  // namespace
}  // namespace nq::kernels
