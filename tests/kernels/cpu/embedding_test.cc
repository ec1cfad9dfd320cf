// CPU Embedding against a direct lookup, and its argument errors.
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
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RoundTo;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

TEST(CpuEmbedding, CopiesTheRowsOfEveryTableDType) {
  std::mt19937_64 rng = MakeRng(2101);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  constexpr std::int64_t kVocab = 37;
  constexpr std::int64_t kDim = 24;
  // Repeats, the first and the last row.
  std::vector<std::int32_t> ids = {0, 5, 5, kVocab - 1, 17};
  for (int i = 0; i < 20; ++i)
    ids.push_back(static_cast<std::int32_t>(RandomInt(rng, 0, kVocab - 1)));
  const std::int64_t tokens = static_cast<std::int64_t>(ids.size());
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::vector<float> table = RoundTo(dtype, RandomNormal(rng, kVocab * kDim, 1.0f));
    Tensor tt = Upload(*backend, table, dtype, {kVocab, kDim});
    Tensor out = AllocateOrFail(*backend, DType::kF32, {tokens, kDim});
    NQ_ASSERT_OK(backend->Embedding(ids, tt, out));
    const std::vector<float> got = Download(*backend, out);
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::int64_t c = 0; c < kDim; ++c) {
        ASSERT_EQ(got[t * kDim + c], table[ids[t] * kDim + c]) << "t=" << t << " c=" << c;
      }
    }
  }
}

TEST(CpuEmbedding, NoIdsIsANoOp) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor table = AllocateOrFail(*backend, DType::kBF16, {4, 8});
  Tensor out = AllocateOrFail(*backend, DType::kF32, {0, 8});
  NQ_EXPECT_OK(backend->Embedding(std::span<const std::int32_t>(), table, out));
}

class CpuEmbeddingErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor table_ = AllocateOrFail(*backend_, DType::kBF16, {10, 8});
  Tensor out_ = AllocateOrFail(*backend_, DType::kF32, {3, 8});
};

TEST_F(CpuEmbeddingErrors, RejectsIdsOutOfRange) {
  EXPECT_THAT(backend_->Embedding(std::vector<std::int32_t>{1, 10, 2}, table_, out_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Embedding: ids[1] = 10 is out of range for table BF16[10, 8] "
                                 "(10 rows)")));
  EXPECT_THAT(backend_->Embedding(std::vector<std::int32_t>{-1, 0, 2}, table_, out_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ids[0] = -1")));
}

TEST_F(CpuEmbeddingErrors, RejectsOutputOfWrongShape) {
  Tensor out = AllocateOrFail(*backend_, DType::kF32, {2, 8});
  EXPECT_THAT(backend_->Embedding(std::vector<std::int32_t>{1, 2, 3}, table_, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Embedding: out is F32[2, 8], expected [3, 8] from 3 ids and "
                                 "table BF16[10, 8]")));
}

TEST_F(CpuEmbeddingErrors, RejectsBadDTypesAndRank) {
  const std::vector<std::int32_t> ids = {1, 2, 3};
  Tensor int_table = AllocateOrFail(*backend_, DType::kI32, {10, 8});
  EXPECT_THAT(backend_->Embedding(ids, int_table, out_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Embedding: table must be F32, BF16 or F16, got I32[10, 8]")));
  Tensor bf16_out = AllocateOrFail(*backend_, DType::kBF16, {3, 8});
  EXPECT_THAT(backend_->Embedding(ids, table_, bf16_out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Embedding: out must be F32, got BF16[3, 8]")));
  Tensor flat = AllocateOrFail(*backend_, DType::kF32, {80});
  EXPECT_THAT(backend_->Embedding(ids, flat, out_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Embedding: table must have rank 2, got F32[80]")));
}

TEST_F(CpuEmbeddingErrors, RejectsAnotherBackendsTable) {
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor table = AllocateOrFail(*other, DType::kF32, {10, 8});
  EXPECT_THAT(backend_->Embedding(std::vector<std::int32_t>{1, 2, 3}, table, out_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Embedding: table F32[10, 8] belongs to another backend")));
}

}  // namespace
}  // namespace nq::kernels
