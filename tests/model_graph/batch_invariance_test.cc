// Speculative verification runs the last token and its drafts in one forward; plain decoding
// runs them one per forward. Greedy output stays identical only if a position's logits do not
// depend on how many tokens share the forward, nor on rows written past the cache's end and
// rolled back: on the CPU backend they must be equal bit for bit (every CPU kernel computes a
// row, or a query, with the same reduction order whatever the row count; DSA selection
// included: index_topk is below the fixtures' lengths).
#include <memory>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "services/model/model.h"
#include "tests/common/status_matchers.h"
#include "tests/model_graph/fixture_util.h"

namespace nq::model {
namespace {

using ::nq::testing::IsOk;

constexpr int64_t kPrefix = 10;

struct Rows {
  std::vector<float> logits;  // [tokens, vocab]
  std::vector<float> hidden;  // [tokens, hidden]
  std::vector<float> mtp;     // [tokens - 1, vocab]: MTP entry i reads hidden i and token i + 1
};

class BatchInvarianceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
    ASSERT_THAT(backend, IsOk());
    backend_ = *std::move(backend);
    tokens_ = testing::ReadTokens(testing::FixtureDir(GetParam()));
    ASSERT_GT(tokens_.size(), static_cast<size_t>(kPrefix + 8));
  }
  std::unique_ptr<Model> Load() {
    absl::StatusOr<std::unique_ptr<Model>> m =
        Model::Load(testing::FixtureDir(GetParam()), *backend_, nullptr, ModelOptions{.max_tokens = 64, .tp = {}});
    EXPECT_THAT(m, IsOk());
    return m.ok() ? *std::move(m) : nullptr;
  }
  // The prompt prefix in one forward, then the rest `chunk` tokens per forward. With
  // `rollback`, each chunk first runs as garbage (the tokens reversed), is truncated away,
  // and then runs for real: what a rejected verification leaves behind.
  Rows Run(int64_t chunk, bool rollback) {
    std::unique_ptr<Model> m = Load();
    Rows rows;
    if (m == nullptr) return rows;
    const std::span<const int32_t> ids(tokens_);
    EXPECT_THAT(m->Forward(ids.first(kPrefix)), IsOk());
    std::vector<float> last_hidden(m->last_hidden().end() - m->config().hidden_size, m->last_hidden().end());
    EXPECT_THAT(m->ForwardMtp(ids.subspan(1, kPrefix - 1),
                              std::span<const float>(m->last_hidden()).first((kPrefix - 1) * m->config().hidden_size)),
                IsOk());
    for (int64_t at = kPrefix; at < static_cast<int64_t>(ids.size()); at += chunk) {
      const std::span<const int32_t> part = ids.subspan(at, std::min<int64_t>(chunk, ids.size() - at));
      if (rollback) {
        std::vector<int32_t> garbage(part.rbegin(), part.rend());
        garbage[0] = (garbage[0] + 1) % static_cast<int32_t>(m->config().vocab_size);
        EXPECT_THAT(m->Forward(garbage), IsOk());
        EXPECT_THAT(m->TruncateCache(at), IsOk());
      }
      absl::StatusOr<std::vector<float>> logits = m->Forward(part);
      if (!logits.ok()) {
        ADD_FAILURE() << "Forward at " << at << ": " << logits.status();
        return rows;
      }
      rows.logits.insert(rows.logits.end(), logits->begin(), logits->end());
      rows.hidden.insert(rows.hidden.end(), m->last_hidden().begin(), m->last_hidden().end());
      // MTP entries for positions at - 1 .. at + |part| - 2 (each needs the token after it).
      std::vector<float> mtp_hidden = last_hidden;
      mtp_hidden.insert(mtp_hidden.end(), m->last_hidden().begin(), m->last_hidden().end() - m->config().hidden_size);
      absl::StatusOr<std::vector<float>> mtp = m->ForwardMtp(part, mtp_hidden);
      if (!mtp.ok()) {
        ADD_FAILURE() << "ForwardMtp at " << at << ": " << mtp.status();
        return rows;
      }
      rows.mtp.insert(rows.mtp.end(), mtp->begin(), mtp->end());
      last_hidden.assign(m->last_hidden().end() - m->config().hidden_size, m->last_hidden().end());
    }
    return rows;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::vector<int32_t> tokens_;
};

TEST_P(BatchInvarianceTest, LogitsDoNotDependOnHowManyTokensShareAForward) {
  const Rows one_by_one = Run(1, false);
  ASSERT_FALSE(one_by_one.logits.empty());
  for (int64_t chunk : {2, 3, 4, 7}) {
    const Rows chunked = Run(chunk, false);
    EXPECT_EQ(chunked.logits, one_by_one.logits) << "chunks of " << chunk;
    EXPECT_EQ(chunked.hidden, one_by_one.hidden) << "chunks of " << chunk;
    EXPECT_EQ(chunked.mtp, one_by_one.mtp) << "chunks of " << chunk;
  }
}

TEST_P(BatchInvarianceTest, RolledBackPositionsLeaveNoTrace) {
  const Rows reference = Run(1, false);
  for (int64_t chunk : {1, 4}) {
    const Rows rolled_back = Run(chunk, true);
    EXPECT_EQ(rolled_back.logits, reference.logits) << "chunks of " << chunk;
    EXPECT_EQ(rolled_back.hidden, reference.hidden) << "chunks of " << chunk;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchInvarianceTest, ::testing::Values("glm5_tiny", "dsv3_tiny"));

}  // namespace
}  // namespace nq::model
