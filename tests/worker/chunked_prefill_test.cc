// Issue #23 in the sequence runner on glm5_nano (CPU): chunked and layer-major prefill give
// the unchunked prefill's output bit for bit (the CPU rows do not depend on how many share a
// forward), a cancel mid-prefill stops within one chunk and leaves a cache the next request
// reuses, a long conversation reuses its prefix across turns, and speculative decoding's MTP
// state is fed chunk by chunk to the same drafts.
#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "services/worker/mtp_drafter.h"
#include "services/worker/sequence_runner.h"
#include "tests/common/status_matchers.h"
#include "tests/worker/nano_model.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using testing::HeldOutText;
using testing::LoadedModel;
using testing::RunResult;

constexpr int kGenerated = 8;


SequenceRequest Greedy(std::vector<int32_t> prompt, uint32_t max_tokens = kGenerated) {
  SequenceRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.top_logprobs = 3;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

class ChunkedPrefillTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (LoadedModel* m : {&model_, &reference_}) {
      absl::StatusOr<LoadedModel> loaded = testing::LoadModel(testing::NanoModelDir());
      ASSERT_THAT(loaded, IsOk());
      *m = *std::move(loaded);
    }
  }
  static void TearDownTestSuite() {
    model_ = {};
    reference_ = {};
  }
  static model::Model* model() { return model_.model.get(); }
  // A runner on the model, or on a second instance (a reference run that must not disturb the
  // first one's cache between a conversation's turns).
  static std::unique_ptr<SequenceRunner> Runner(int64_t chunk, int64_t layer_major_min = 0, bool reference = false) {
    model::Model* m = reference ? reference_.model.get() : model();
    auto runner = std::make_unique<SequenceRunner>(
        m, std::vector<int32_t>(m->config().eos_token_ids.begin(), m->config().eos_token_ids.end()));
    EXPECT_THAT(runner->SetPrefillOptions({.chunk_tokens = chunk, .layer_major_min_tokens = layer_major_min}), IsOk());
    return runner;
  }
  static RunResult Run(SequenceRunner& runner, const SequenceRequest& request) {
    absl::StatusOr<RunResult> result = testing::Generate(runner, request);
    EXPECT_THAT(result, IsOk());
    return result.ok() ? *result : RunResult{};
  }
  static void ExpectSame(const RunResult& a, const RunResult& b, const std::string& what) {
    ASSERT_EQ(a.ids.size(), static_cast<size_t>(kGenerated)) << what;
    EXPECT_EQ(a.ids, b.ids) << what;
    EXPECT_EQ(a.logprobs, b.logprobs) << what;  // bit for bit
    ASSERT_FALSE(a.steps.empty());
    ASSERT_FALSE(b.steps.empty());
    EXPECT_EQ(a.steps[0].tokens[0].top, b.steps[0].tokens[0].top) << what;  // the prefill's last row
  }

  static LoadedModel model_;
  static LoadedModel reference_;
};
LoadedModel ChunkedPrefillTest::model_;
LoadedModel ChunkedPrefillTest::reference_;

TEST_F(ChunkedPrefillTest, RefusesAChunkWithoutTokens) {
  SequenceRunner runner(model(), {});
  EXPECT_THAT(runner.SetPrefillOptions({.chunk_tokens = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--prefill_chunk_tokens=0")));
  EXPECT_THAT(runner.SetPrefillOptions({.chunk_tokens = 8, .layer_major_min_tokens = -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--layer_major_prefill_tokens=-1")));
}

TEST_F(ChunkedPrefillTest, ChunkedAndLayerMajorPrefillGiveTheUnchunkedOutput) {
  for (size_t offset : {0u, 5000u}) {
    const SequenceRequest request = Greedy(HeldOutText(offset, 300));
    const RunResult whole = Run(*Runner(4096), request);
    for (int64_t chunk : {64, 37}) {
      std::unique_ptr<SequenceRunner> runner = Runner(chunk);
      std::vector<int64_t> kept;
      runner->SetKeptTokensObserver([&](int64_t k) { kept.push_back(k); });
      const RunResult chunked = Run(*runner, request);
      ExpectSame(chunked, whole, "token order, chunks of " + std::to_string(chunk));
      // ceil(300 / chunk) prefill forwards, then one per decode step.
      ASSERT_EQ(kept.size(), static_cast<size_t>((300 + chunk - 1) / chunk + kGenerated - 1));
      EXPECT_EQ(kept[0], chunk);
      const RunResult layer_major = Run(*Runner(chunk, 200), request);
      ExpectSame(layer_major, whole, "layer-major, chunks of " + std::to_string(chunk));
    }
  }
}

TEST_F(ChunkedPrefillTest, CancelMidPrefillStopsWithinOneChunkAndTheNextRequestReusesTheChunksDone) {
  const SequenceRequest request = Greedy(HeldOutText(900, 320));
  const RunResult fresh = Run(*Runner(4096), request);
  std::unique_ptr<SequenceRunner> runner = Runner(64);
  int64_t forwards = 0;
  runner->SetKeptTokensObserver([&](int64_t) { ++forwards; });
  int checks = 0;
  std::vector<SequenceStep> steps;
  // The client goes away while the third chunk runs: the check after it stops the sequence.
  absl::StatusOr<SequenceStats> stats = runner->Run(
      request,
      [&](const SequenceStep& step) {
        steps.push_back(step);
        return true;
      },
      [&] { return ++checks > 3; });
  ASSERT_THAT(stats, IsOk());
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].finish, nq::v1::FINISH_REASON_ABORT);
  EXPECT_TRUE(steps[0].tokens.empty());
  EXPECT_EQ(forwards, 3);
  EXPECT_EQ(model()->cache_length(), 3 * 64);
  // The worker serves the next request, reusing the three chunks it kept.
  forwards = 0;
  absl::StatusOr<SequenceStats> next_stats;
  RunResult next;
  next_stats = runner->Run(
      request,
      [&](const SequenceStep& step) {
        for (const SampledToken& t : step.tokens) {
          next.ids.push_back(t.id);
          next.logprobs.push_back(t.logprob);
        }
        next.steps.push_back(step);
        return true;
      },
      [] { return false; });
  ASSERT_THAT(next_stats, IsOk());
  EXPECT_EQ(next_stats->cached_prompt_tokens, 3u * 64);
  ExpectSame(next, fresh, "after a cancelled prefill");
}

TEST_F(ChunkedPrefillTest, CancelDuringALayerMajorPrefillKeepsTheCacheBeforeIt) {
  const SequenceRequest first = Greedy(HeldOutText(2000, 120));
  std::unique_ptr<SequenceRunner> runner = Runner(32, 100);
  const RunResult first_result = Run(*runner, first);
  ASSERT_EQ(first_result.ids.size(), static_cast<size_t>(kGenerated));
  // The next turn extends the conversation by 250 tokens, prefilled layer-major; the client
  // leaves after a few (layer, chunk) steps.
  std::vector<int32_t> longer = first.prompt;
  const std::vector<int32_t> more = HeldOutText(2120, 250);
  longer.insert(longer.end(), more.begin(), more.end());
  const SequenceRequest second = Greedy(longer);
  int checks = 0;
  std::vector<SequenceStep> steps;
  ASSERT_THAT(runner->Run(
                  second,
                  [&](const SequenceStep& step) {
                    steps.push_back(step);
                    return true;
                  },
                  [&] { return ++checks > 6; }),
              IsOk());
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].finish, nq::v1::FINISH_REASON_ABORT);
  // What the turns share survives: the first prompt and as many of its emitted tokens (but the
  // last, which has no KV) as the new text happens to repeat.
  size_t shared = first.prompt.size();
  while (shared < first.prompt.size() + kGenerated - 1 && more[shared - first.prompt.size()] ==
                                                                 first_result.ids[shared - first.prompt.size()]) {
    ++shared;
  }
  EXPECT_EQ(model()->cache_length(), static_cast<int64_t>(shared));
  absl::StatusOr<RunResult> again = testing::Generate(*runner, second);
  ASSERT_THAT(again, IsOk());
  ExpectSame(*again, Run(*Runner(4096), second), "after a cancelled layer-major prefill");
}

TEST_F(ChunkedPrefillTest, ALongConversationReusesItsPrefixEveryTurn) {
  std::unique_ptr<SequenceRunner> runner = Runner(48, 64);
  std::vector<int32_t> conversation = HeldOutText(7000, 150);
  for (int turn = 0; turn < 3; ++turn) {
    const SequenceRequest request = Greedy(conversation);
    absl::StatusOr<SequenceStats> stats;
    RunResult result;
    stats = runner->Run(
        request,
        [&](const SequenceStep& step) {
          for (const SampledToken& t : step.tokens) {
            result.ids.push_back(t.id);
            result.logprobs.push_back(t.logprob);
          }
          result.steps.push_back(step);
          return true;
        },
        [] { return false; });
    ASSERT_THAT(stats, IsOk());
    // Every turn but the first keeps the whole previous turn but its last emitted token.
    if (turn > 0) EXPECT_EQ(stats->cached_prompt_tokens, conversation.size() - 1 - 100) << "turn " << turn;
    ExpectSame(result, Run(*Runner(4096, 0, true), request), "turn " + std::to_string(turn));
    // The next turn: this turn's reply and 100 tokens of new text (a long new span: layer-major).
    conversation.insert(conversation.end(), result.ids.begin(), result.ids.end());
    const std::vector<int32_t> user = HeldOutText(7500 + 100 * turn, 100);
    conversation.insert(conversation.end(), user.begin(), user.end());
  }
}

// Records what the MTP drafter proposes, by sequence length.
class RecordingDrafter final : public Drafter {
 public:
  explicit RecordingDrafter(Drafter* inner) : inner_(inner) {}
  absl::Status BeginSequence(const SamplingConfig& s) override { return inner_->BeginSequence(s); }
  int64_t CoveredPositions() const override { return inner_->CoveredPositions(); }
  absl::StatusOr<Drafts> Propose(const DraftRequest& r) override {
    max_kept = std::max(max_kept, r.kept);
    absl::StatusOr<Drafts> drafts = inner_->Propose(r);
    if (drafts.ok() && !drafts->tokens.empty()) proposed[r.sequence.size()] = drafts->tokens;
    return drafts;
  }
  int64_t max_kept = 0;  // the most positions one Propose fed the MTP layer
  std::map<size_t, std::vector<int32_t>> proposed;

 private:
  Drafter* const inner_;
};

TEST_F(ChunkedPrefillTest, TheDrafterIsFedChunkByChunkToTheSameDrafts) {
  const SequenceRequest request = Greedy(HeldOutText(11000, 200), 12);
  const RunResult plain = Run(*Runner(4096), request);
  std::map<size_t, std::vector<int32_t>> reference;
  for (auto [chunk, layer_major_min] : std::vector<std::pair<int64_t, int64_t>>{{4096, 0}, {50, 0}, {50, 150}}) {
    MtpDrafter mtp(model());
    RecordingDrafter drafter(&mtp);
    std::unique_ptr<SequenceRunner> runner = Runner(chunk, layer_major_min);
    runner->SetDrafter(&drafter, 3);
    const RunResult spec = Run(*runner, request);
    const std::string what = "chunks of " + std::to_string(chunk) + (layer_major_min > 0 ? ", layer-major" : "");
    EXPECT_EQ(spec.ids, plain.ids) << what;
    if (chunk == 4096) {
      reference = drafter.proposed;
      ASSERT_FALSE(reference.empty());
      EXPECT_EQ(drafter.max_kept, 200);  // the whole prefill in one MTP forward
    } else {
      EXPECT_EQ(drafter.proposed, reference) << what;
      EXPECT_EQ(drafter.max_kept, 50) << what;  // the prefill reached the MTP layer in chunks
    }
  }
}

}  // namespace
}  // namespace nq::worker
