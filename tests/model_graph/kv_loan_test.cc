// Room the free KV cache lends a layer-major prefill for extra expert slots (issue #23's slot
// borrowing; services/model/kv_loan.h): which bytes are free past a token, the pieces a loan
// carves (aligned, disjoint, never in a live row), one loan at a time, and the model refusing
// every forward that would write a lent row until the loan is back.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "services/model/kv_cache.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "tests/common/status_matchers.h"
#include "tests/model_graph/fixture_util.h"

namespace nq::model {
namespace {

using ::nq::model::testing::FixtureDir;
using ::nq::model::testing::ReadTokens;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int64_t kMaxTokens = 200;

class KvLoanTest : public ::testing::TestWithParam<kernels::DType> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
    ASSERT_THAT(backend, IsOk());
    backend_ = *std::move(backend);
    absl::StatusOr<ModelConfig> config = LoadModelConfig(FixtureDir("glm5_tiny"));
    ASSERT_THAT(config, IsOk());
    config_ = *config;
    absl::StatusOr<KvCache> cache =
        KvCache::Create(*backend_, config_, KvCacheIndexerLayers(config_), kMaxTokens, GetParam());
    ASSERT_THAT(cache, IsOk());
    cache_ = std::make_unique<KvCache>(*std::move(cache));
  }
  // Bytes of one token's row of a cache tensor.
  static size_t RowBytes(const kernels::Tensor& t) { return t.nbytes() / static_cast<size_t>(kMaxTokens); }

  std::unique_ptr<kernels::Backend> backend_;
  ModelConfig config_;
  std::unique_ptr<KvCache> cache_;
};

TEST_P(KvLoanTest, FreeRoomIsEveryCacheTensorPastTheToken) {
  // glm5_tiny: 2 decoder layers (a full indexer, then a shared one) and an MTP layer with one.
  ASSERT_EQ(cache_->num_layers(), 3u);
  constexpr int64_t kFrom = 37;
  const std::vector<KvCacheRange> room = cache_->FreeRoom(kFrom);
  ASSERT_EQ(room.size(), 3u + 3u + 2u) << "latent and rope key of each layer, indexer keys of layers 0 and 2";
  for (const KvCacheRange& r : room) {
    const kernels::Tensor* t = cache_->tensor(r.cache_layer, r.part);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(r.offset, kFrom * RowBytes(*t)) << KvCachePartName(r.part) << " of layer " << r.cache_layer;
    EXPECT_EQ(r.offset + r.bytes, t->nbytes());
  }
  EXPECT_EQ(cache_->tensor(1, KvCachePart::kIndexKeys), nullptr) << "a shared indexer layer keeps no keys";
  EXPECT_EQ(cache_->FreeRoom(0).front().bytes, cache_->tensor(0, KvCachePart::kLatent)->nbytes());
  EXPECT_TRUE(cache_->FreeRoom(kMaxTokens).empty());
  EXPECT_TRUE(cache_->FreeRoom(-1).empty());
}

// What the prefill relies on: each piece lies inside its tensor, past the span's rows, at an
// address aligned to kKvLoanAlign, apart from every other piece, record_bytes long.
TEST_P(KvLoanTest, LentPiecesAreAlignedDisjointAndPastTheSpan) {
  for (const int64_t from : {int64_t{0}, int64_t{37}, int64_t{150}, kMaxTokens - 3}) {
    for (const int64_t record_bytes : {int64_t{1000}, int64_t{4096}}) {
      SCOPED_TRACE(::testing::Message() << "from row " << from << ", records of " << record_bytes << " bytes");
      cache_->set_length(from);
      const int64_t lendable = cache_->LendableRecords(from, record_bytes, 1000);
      absl::StatusOr<KvLoan> loan = cache_->Lend(from, record_bytes, 1000);
      ASSERT_THAT(loan, IsOk());
      ASSERT_EQ(static_cast<int64_t>(loan->records().size()), lendable);
      EXPECT_EQ(loan->outstanding(), lendable > 0);
      // The most that could fit, alignment aside, bounds what was carved; rows past 150 of 200
      // hold at least one 1000-byte record in the F32 latent (192 bytes a row).
      int64_t free_bytes = 0;
      for (const KvCacheRange& r : cache_->FreeRoom(from)) free_bytes += static_cast<int64_t>(r.bytes);
      EXPECT_LE(lendable * record_bytes, free_bytes);
      if (from <= 150 && record_bytes == 1000 && GetParam() == kernels::DType::kF32) EXPECT_GT(lendable, 0);
      for (size_t i = 0; i < loan->records().size(); ++i) {
        const KvLentRecord& a = loan->records()[i];
        ASSERT_EQ(a.tensor, cache_->tensor(a.range.cache_layer, a.range.part)) << "piece " << i;
        EXPECT_EQ(a.range.bytes, static_cast<size_t>(record_bytes));
        EXPECT_GE(a.range.offset, static_cast<size_t>(from) * RowBytes(*a.tensor)) << "piece " << i << " in live rows";
        EXPECT_LE(a.range.offset + a.range.bytes, a.tensor->nbytes()) << "piece " << i;
        EXPECT_EQ(reinterpret_cast<uintptr_t>(a.address()) % kKvLoanAlign, 0u) << "piece " << i;
        for (size_t j = 0; j < i; ++j) {
          const KvLentRecord& b = loan->records()[j];
          if (a.tensor != b.tensor) continue;
          EXPECT_TRUE(a.range.offset >= b.range.offset + b.range.bytes || b.range.offset >= a.range.offset + a.range.bytes)
              << "pieces " << j << " and " << i << " overlap";
        }
      }
      loan->Return();
      EXPECT_FALSE(cache_->lent_from().has_value());
    }
  }
}

TEST_P(KvLoanTest, FewerPiecesAsTheSpanNearsTheEndAndNoneWhereNoneFits) {
  const int64_t at_start = cache_->LendableRecords(0, 1000, 1000);
  const int64_t near_end = cache_->LendableRecords(kMaxTokens - 20, 1000, 1000);
  EXPECT_GT(at_start, near_end);
  EXPECT_EQ(cache_->LendableRecords(0, 1000, 3), 3) << "at most max_records";
  // A record longer than any cache tensor: nothing is lent, and nothing is out.
  absl::StatusOr<KvLoan> none = cache_->Lend(0, 1 << 30, 4);
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(none->records().empty());
  EXPECT_FALSE(none->outstanding());
  EXPECT_FALSE(cache_->lent_from().has_value());
}

TEST_P(KvLoanTest, OneLoanAtATimeNeverOfLiveRowsAndWritesIntoItAreRefused) {
  cache_->set_length(100);
  EXPECT_THAT(cache_->Lend(60, 1000, 4), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("live")));
  absl::StatusOr<KvLoan> loan = cache_->Lend(120, 1000, 4);
  ASSERT_THAT(loan, IsOk());
  ASSERT_TRUE(loan->outstanding());
  EXPECT_EQ(cache_->lent_from(), 120);
  EXPECT_THAT(cache_->Lend(150, 1000, 4),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lent already")));
  EXPECT_THAT(cache_->CheckWritable(100, 20, "Forward"), IsOk()) << "the span below the loan";
  EXPECT_THAT(cache_->CheckWritable(100, 21, "Forward"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("Forward: rows [100, 121)")));
  // Moving the loan keeps it out; dropping it returns it.
  {
    KvLoan moved = *std::move(loan);
    EXPECT_FALSE(loan->outstanding());
    EXPECT_TRUE(moved.outstanding());
    EXPECT_EQ(cache_->lent_from(), 120);
  }
  EXPECT_FALSE(cache_->lent_from().has_value());
  EXPECT_THAT(cache_->CheckWritable(100, 100, "Forward"), IsOk());
  EXPECT_THAT(cache_->Lend(150, 1000, 4), IsOk());
}

TEST_P(KvLoanTest, RefusesBadArguments) {
  EXPECT_THAT(cache_->Lend(0, 0, 4), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("records of 0 bytes")));
  EXPECT_THAT(cache_->Lend(0, 1000, -1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("up to -1 records")));
  EXPECT_THAT(cache_->Lend(kMaxTokens + 1, 1000, 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("from row 201 of 200")));
  EXPECT_EQ(cache_->LendableRecords(0, 0, 4), 0);
}

INSTANTIATE_TEST_SUITE_P(CacheDTypes, KvLoanTest,
                         ::testing::Values(kernels::DType::kF32, kernels::DType::kBF16, kernels::DType::kF8E4M3),
                         [](const ::testing::TestParamInfo<kernels::DType>& info) {
                           return std::string(kernels::DTypeName(info.param));
                         });

// The model side: a loan past the span is what a layer-major prefill borrows, and while it is out
// no forward (decoder stack, MTP layer, layer-major) may write a lent row.
TEST(ModelKvLoanTest, ForwardsIntoLentRowsAreRefusedUntilTheLoanIsBack) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<Model>> loaded =
      Model::Load(FixtureDir("glm5_tiny"), **backend, nullptr, ModelOptions{.max_tokens = 64, .tp = {}});
  ASSERT_THAT(loaded, IsOk());
  Model& m = **loaded;
  const std::vector<int32_t> tokens = ReadTokens(FixtureDir("glm5_tiny"));
  ASSERT_GE(tokens.size(), 12u);
  const std::span<const int32_t> ids(tokens);
  ASSERT_THAT(m.Forward(ids.first(6)), IsOk());
  // The MTP layer's cache runs ahead of the decoder's here (drafts): its rows are live too.
  const int64_t D = m.config().hidden_size;
  ASSERT_THAT(m.ForwardMtp(ids.subspan(1, 8), std::vector<float>(static_cast<size_t>(8 * D), 0.1f)), IsOk());
  ASSERT_EQ(m.mtp_cache_length(), 8);
  EXPECT_THAT(m.LendKvRoom(7, 256, 4), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("MTP")));
  EXPECT_THAT(m.LendKvRoom(5, 256, 4), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("live")));

  absl::StatusOr<KvLoan> loan = m.LendKvRoom(10, 256, 4);
  ASSERT_THAT(loan, IsOk());
  ASSERT_EQ(loan->records().size(), 4u);
  EXPECT_EQ(m.LendableKvRecords(10, 256, 4), 4);
  EXPECT_THAT(m.Forward(ids.first(5)), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lent")));
  EXPECT_THAT(m.ForwardMtp(ids.subspan(1, 3), std::vector<float>(static_cast<size_t>(3 * D), 0.1f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ForwardMtp")));
  EXPECT_THAT(m.PrefillLayerMajor(ids.first(5), {.chunk_tokens = 2, .before_moe = nullptr, .cancelled = nullptr}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("PrefillLayerMajor")));
  EXPECT_EQ(m.cache_length(), 6) << "a refused forward changes nothing";
  // Below the loan the cache still grows (the span a borrowing prefill writes).
  ASSERT_THAT(m.Forward(ids.subspan(6, 4)), IsOk());
  EXPECT_EQ(m.cache_length(), 10);
  loan->Return();
  EXPECT_THAT(m.Forward(ids.subspan(10, 2)), IsOk());
  EXPECT_EQ(m.cache_length(), 12);
}

}  // namespace
}  // namespace nq::model
