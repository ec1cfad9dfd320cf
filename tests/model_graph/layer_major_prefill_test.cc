// Layer-major prefill (issue #23) against token-order prefill on the CPU backend. Every
// (layer, chunk) computation gets the same tensors in both orders, and the CPU kernels compute a
// row with the same reduction order whatever the row count (batch_invariance_test.cc), so the
// logits, hidden states, KV cache (seen through the next decode step) and MTP state must be
// equal bit for bit. glm5_tiny has a DSA indexer (index_topk 8, below the fixture's 28 tokens)
// with a shared layer; dsv3_tiny has none.
#include <map>
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
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

struct Outcome {
  std::vector<float> last_logits;  // the prefill's last row
  std::vector<float> hidden;       // last_hidden() after the prefill
  std::vector<float> next_logits;  // one decode step after it (reads the whole cache)
  std::vector<float> mtp;          // the MTP layer over the prefill's entries
};

class LayerMajorPrefillTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
    ASSERT_THAT(backend, IsOk());
    backend_ = *std::move(backend);
    tokens_ = testing::ReadTokens(testing::FixtureDir(GetParam()));
    ASSERT_GE(tokens_.size(), 20u);
  }
  std::unique_ptr<Model> Load() {
    absl::StatusOr<std::unique_ptr<Model>> m =
        Model::Load(testing::FixtureDir(GetParam()), *backend_, nullptr, ModelOptions{.max_tokens = 64, .tp = {}});
    EXPECT_THAT(m, IsOk());
    return m.ok() ? *std::move(m) : nullptr;
  }
  // After `reused` tokens in one Forward (a previous turn's prefix), the rest of the prompt but
  // its last token: token order in Forward calls of `chunk`, or layer-major in chunks of `chunk`
  // (chunk 0: one Forward). Then one decode step on the last token, and the MTP layer.
  Outcome Run(int64_t reused, int64_t chunk, bool layer_major) {
    Outcome out;
    std::unique_ptr<Model> m = Load();
    if (m == nullptr) return out;
    const std::span<const int32_t> ids(tokens_);
    const std::span<const int32_t> prompt = ids.first(ids.size() - 1);
    if (reused > 0) EXPECT_THAT(m->Forward(prompt.first(reused)), IsOk());
    const std::span<const int32_t> span = prompt.subspan(reused);
    std::vector<float> hidden;
    if (layer_major) {
      absl::StatusOr<std::vector<float>> logits = m->PrefillLayerMajor(span, {.chunk_tokens = chunk});
      EXPECT_THAT(logits, IsOk());
      if (!logits.ok()) return out;
      out.last_logits = *logits;
      hidden = m->last_hidden();
    } else {
      const int64_t step = chunk > 0 ? chunk : static_cast<int64_t>(span.size());
      for (size_t at = 0; at < span.size(); at += step) {
        absl::StatusOr<std::vector<float>> logits =
            m->ForwardLast(span.subspan(at, std::min<size_t>(step, span.size() - at)));
        EXPECT_THAT(logits, IsOk());
        if (!logits.ok()) return out;
        out.last_logits = *logits;
        hidden.insert(hidden.end(), m->last_hidden().begin(), m->last_hidden().end());
      }
    }
    out.hidden = hidden;
    EXPECT_EQ(m->cache_length(), static_cast<int64_t>(prompt.size()));
    absl::StatusOr<std::vector<float>> next = m->Forward(ids.last(1));
    EXPECT_THAT(next, IsOk());
    if (next.ok()) out.next_logits = *next;
    // MTP entry i reads hidden i and the token after it (the span's tokens from its second on).
    const int64_t D = m->config().hidden_size;
    absl::StatusOr<std::vector<float>> mtp = m->ForwardMtp(
        ids.subspan(reused + 1, span.size()), std::span<const float>(hidden).first(span.size() * D));
    EXPECT_THAT(mtp, IsOk());
    if (mtp.ok()) out.mtp = *mtp;
    return out;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::vector<int32_t> tokens_;
};

TEST_P(LayerMajorPrefillTest, EqualsTokenOrderPrefillBitForBit) {
  for (int64_t chunk : {1, 3, 8, 64}) {
    const Outcome token_order = Run(0, chunk, false);
    const Outcome layer_major = Run(0, chunk, true);
    ASSERT_FALSE(token_order.last_logits.empty());
    EXPECT_EQ(layer_major.last_logits, token_order.last_logits) << "chunks of " << chunk;
    EXPECT_EQ(layer_major.hidden, token_order.hidden) << "chunks of " << chunk;
    EXPECT_EQ(layer_major.next_logits, token_order.next_logits) << "chunks of " << chunk;
    EXPECT_EQ(layer_major.mtp, token_order.mtp) << "chunks of " << chunk;
  }
  // And against one unchunked forward (the CPU rows do not depend on the row count).
  const Outcome whole = Run(0, 0, false);
  const Outcome layer_major = Run(0, 5, true);
  EXPECT_EQ(layer_major.last_logits, whole.last_logits);
  EXPECT_EQ(layer_major.next_logits, whole.next_logits);
}

TEST_P(LayerMajorPrefillTest, ContinuesAReusedPrefix) {
  // A later turn keeps the first 9 tokens' KV and prefills the rest layer-major.
  const Outcome token_order = Run(9, 4, false);
  const Outcome layer_major = Run(9, 4, true);
  ASSERT_FALSE(token_order.next_logits.empty());
  EXPECT_EQ(layer_major.last_logits, token_order.last_logits);
  EXPECT_EQ(layer_major.hidden, token_order.hidden);
  EXPECT_EQ(layer_major.next_logits, token_order.next_logits);
  EXPECT_EQ(layer_major.mtp, token_order.mtp);
}

TEST_P(LayerMajorPrefillTest, HookSeesEachMoeLayerOnceWithEveryChunksRouting) {
  std::unique_ptr<Model> token_order = Load();
  std::unique_ptr<Model> layer_major = Load();
  ASSERT_NE(token_order, nullptr);
  ASSERT_NE(layer_major, nullptr);
  std::map<int64_t, MoeRouting> expected;
  token_order->SetRoutingObserver([&](int64_t layer, const MoeRouting& r) { expected[layer] = r; });
  const std::span<const int32_t> ids(tokens_);
  ASSERT_THAT(token_order->Forward(ids), IsOk());

  std::vector<int64_t> hooked;
  std::map<int64_t, MoeRouting> observed;
  layer_major->SetRoutingObserver([&](int64_t layer, const MoeRouting& r) { observed[layer] = r; });
  Model::LayerMajorOptions options{.chunk_tokens = 6};
  options.before_moe = [&](int64_t layer, std::span<const MoeRouting> chunks)
      -> absl::StatusOr<std::optional<Model::PrefillLayerSlots>> {
    hooked.push_back(layer);
    EXPECT_EQ(chunks.size(), (tokens_.size() + 5) / 6);
    std::vector<int32_t> experts;
    for (const MoeRouting& r : chunks) experts.insert(experts.end(), r.experts.begin(), r.experts.end());
    EXPECT_EQ(experts, expected[layer].experts) << "layer " << layer;
    return std::nullopt;
  };
  ASSERT_THAT(layer_major->PrefillLayerMajor(ids, options), IsOk());
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < layer_major->config().num_hidden_layers; ++l) {
    if (layer_major->config().IsMoeLayer(l)) moe_layers.push_back(l);
  }
  ASSERT_FALSE(moe_layers.empty());
  EXPECT_EQ(hooked, moe_layers);
  ASSERT_EQ(observed.size(), expected.size());
  for (const auto& [layer, r] : expected) {
    EXPECT_EQ(observed[layer].num_tokens, r.num_tokens);
    EXPECT_EQ(observed[layer].experts, r.experts);
    EXPECT_EQ(observed[layer].weights, r.weights);
  }
}

TEST_P(LayerMajorPrefillTest, CancelledOrFailedPrefillKeepsTheCacheLength) {
  std::unique_ptr<Model> m = Load();
  ASSERT_NE(m, nullptr);
  const std::span<const int32_t> ids(tokens_);
  ASSERT_THAT(m->Forward(ids.first(4)), IsOk());
  int checks = 0;
  Model::LayerMajorOptions options{.chunk_tokens = 4};
  options.cancelled = [&] { return ++checks > 5; };
  EXPECT_THAT(m->PrefillLayerMajor(ids.subspan(4), options), StatusIs(absl::StatusCode::kCancelled, HasSubstr("cancelled")));
  EXPECT_EQ(checks, 6);  // stopped at the first check after the flag turned
  EXPECT_EQ(m->cache_length(), 4);
  Model::LayerMajorOptions failing{.chunk_tokens = 4};
  failing.before_moe = [](int64_t, std::span<const MoeRouting>) -> absl::StatusOr<std::optional<Model::PrefillLayerSlots>> {
    return absl::UnavailableError("no slots");
  };
  EXPECT_THAT(m->PrefillLayerMajor(ids.subspan(4), failing), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no slots")));
  EXPECT_EQ(m->cache_length(), 4);
  // What the cancelled and failed runs wrote past the cache's end leaves no trace.
  ASSERT_THAT(m->PrefillLayerMajor(ids.subspan(4), {.chunk_tokens = 7}), IsOk());
  std::unique_ptr<Model> fresh = Load();
  ASSERT_NE(fresh, nullptr);
  ASSERT_THAT(fresh->Forward(ids), IsOk());
  EXPECT_EQ(m->last_hidden(), std::vector<float>(fresh->last_hidden().begin() + 4 * m->config().hidden_size,
                                                 fresh->last_hidden().end()));
  EXPECT_THAT(m->PrefillLayerMajor(ids.first(1), {.chunk_tokens = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chunk_tokens")));
  const std::vector<int32_t> too_many(static_cast<size_t>(m->max_tokens() - m->cache_length() + 1), ids[0]);
  EXPECT_THAT(m->PrefillLayerMajor(too_many, {.chunk_tokens = 4}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed the cache")));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LayerMajorPrefillTest, ::testing::Values("glm5_tiny", "dsv3_tiny"));

}  // namespace
}  // namespace nq::model
