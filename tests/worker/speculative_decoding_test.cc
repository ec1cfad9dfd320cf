// Speculative decoding in the sequence runner on glm5_nano (CPU): greedy output identical to
// plain decoding with every step accepting exactly the drafts plain greedy decoding emits,
// rollback after a rejection at every draft position, stop tokens and
// max_tokens inside an accepted run, the MTP drafter's state against a teacher-forced pass, and
// greedy drafts chained on the backend (Model::DraftOnDevice) against the host's.
#include <algorithm>
#include <limits>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/worker/mtp_drafter.h"
#include "services/worker/sequence_runner.h"
#include "services/worker/step_command.h"
#include "tests/common/status_matchers.h"
#include "tests/worker/nano_model.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using testing::Generate;
using testing::LoadedModel;
using testing::RunResult;

constexpr int kGeneratedTokens = 32;

SequenceRequest Greedy(std::vector<int32_t> prompt, uint32_t max_tokens = kGeneratedTokens) {
  SequenceRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.top_logprobs = 2;
  r.max_tokens = max_tokens;
  return r;
}

// Drafts what plain decoding emits (the test knows it), except at `wrong_position` of every
// step's drafts, where it drafts another token: each verification then rejects exactly there.
class OracleDrafter final : public Drafter {
 public:
  OracleDrafter(size_t prompt_size, std::vector<int32_t> plain, int wrong_position, int64_t vocab)
      : prompt_size_(prompt_size), plain_(std::move(plain)), wrong_position_(wrong_position), vocab_(vocab) {}
  absl::Status BeginSequence(const SamplingConfig&) override { return absl::OkStatus(); }
  int64_t CoveredPositions() const override { return std::numeric_limits<int64_t>::max(); }
  absl::StatusOr<Drafts> Propose(const DraftRequest& r) override {
    Drafts drafts;
    const size_t generated = r.sequence.size() - prompt_size_;
    for (int i = 0; i < r.num_drafts; ++i) {
      const size_t at = generated + static_cast<size_t>(i);
      int32_t token = at < plain_.size() ? plain_[at] : 0;
      if (i == wrong_position_) token = static_cast<int32_t>((token + 1) % vocab_);
      drafts.tokens.push_back(token);
    }
    return drafts;
  }

 private:
  const size_t prompt_size_;
  const std::vector<int32_t> plain_;
  const int wrong_position_;
  const int64_t vocab_;
};

// Records, for every Propose of the MTP drafter it wraps, the sequence and the drafts.
class RecordingDrafter final : public Drafter {
 public:
  explicit RecordingDrafter(Drafter* inner) : inner_(inner) {}
  absl::Status BeginSequence(const SamplingConfig& s) override { return inner_->BeginSequence(s); }
  int64_t CoveredPositions() const override { return inner_->CoveredPositions(); }
  absl::StatusOr<Drafts> Propose(const DraftRequest& r) override {
    absl::StatusOr<Drafts> drafts = inner_->Propose(r);
    if (drafts.ok() && !drafts->tokens.empty()) {
      first_drafts[r.sequence.size()] = drafts->tokens[0];
      all_drafts[r.sequence.size()] = drafts->tokens;
    }
    return drafts;
  }
  std::map<size_t, int32_t> first_drafts;  // sequence length -> the draft for the token at that index
  std::map<size_t, std::vector<int32_t>> all_drafts;  // sequence length -> the drafts from that index on

 private:
  Drafter* const inner_;
};

class SpeculativeDecodingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (LoadedModel* m : {&plain_model_, &spec_model_}) {
      absl::StatusOr<LoadedModel> loaded = testing::LoadModel(testing::NanoModelDir());
      ASSERT_THAT(loaded, IsOk());
      *m = *std::move(loaded);
    }
    ASSERT_TRUE(spec_model_.model->has_mtp());
  }
  static void TearDownTestSuite() {
    plain_model_ = {};
    spec_model_ = {};
  }
  static std::vector<int32_t> Eos(const LoadedModel& m) {
    return {m.model->config().eos_token_ids.begin(), m.model->config().eos_token_ids.end()};
  }
  RunResult Plain(const SequenceRequest& request) {
    SequenceRunner runner(plain_model_.model.get(), Eos(plain_model_));
    absl::StatusOr<RunResult> result = Generate(runner, request);
    EXPECT_THAT(result, IsOk());
    return result.ok() ? *result : RunResult{};
  }
  int64_t vocab() const { return spec_model_.model->config().vocab_size; }

  static LoadedModel plain_model_;
  static LoadedModel spec_model_;
};
LoadedModel SpeculativeDecodingTest::plain_model_;
LoadedModel SpeculativeDecodingTest::spec_model_;

// What greedy verification must accept of `drafts` proposed for the tokens from index `at` of
// the output: the longest prefix equal to plain (non-speculative) greedy decoding's tokens there,
// ending early where plain decoding ended.
int GreedyAccepted(const std::vector<int32_t>& drafts, const std::vector<int32_t>& plain, size_t at) {
  int accepted = 0;
  while (static_cast<size_t>(accepted) < drafts.size() && at + accepted < plain.size() &&
         drafts[accepted] == plain[at + accepted]) {
    ++accepted;
  }
  return accepted;
}

void ExpectSameOutput(const RunResult& plain, const RunResult& spec, const std::string& what) {
  EXPECT_EQ(spec.ids, plain.ids) << what;
  EXPECT_EQ(spec.logprobs, plain.logprobs) << what;  // bit for bit: the same logits
  EXPECT_EQ(spec.finish, plain.finish) << what;
}

TEST_F(SpeculativeDecodingTest, GreedyOutputIsPlainDecodingsTokenForTokenOnManyPrompts) {
  const std::vector<std::vector<int32_t>> prompts = testing::HeldOutPrompts(12);
  std::vector<RunResult> plain;
  for (const std::vector<int32_t>& prompt : prompts) plain.push_back(Plain(Greedy(prompt)));
  MtpDrafter mtp(spec_model_.model.get());
  RecordingDrafter drafter(&mtp);
  for (int n : {1, 3, 5}) {
    SequenceRunner runner(spec_model_.model.get(), Eos(spec_model_));
    runner.SetDrafter(&drafter, n);
    int drafts = 0, accepted = 0, multi_token_steps = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string what = "N=" + std::to_string(n) + " prompt " + std::to_string(i);
      drafter.all_drafts.clear();
      absl::StatusOr<RunResult> spec = Generate(runner, Greedy(prompts[i]));
      ASSERT_THAT(spec, IsOk());
      ExpectSameOutput(plain[i], *spec, what);
      size_t generated = 0;  // tokens emitted before the step
      for (const SequenceStep& step : spec->steps) {
        EXPECT_LE(step.drafts, n);
        if (step.drafts > 0) {
          // A draft is accepted iff it is the token plain greedy decoding emits there.
          const auto proposed = drafter.all_drafts.find(prompts[i].size() + generated);
          ASSERT_NE(proposed, drafter.all_drafts.end()) << what << ": no drafts recorded at " << generated;
          ASSERT_EQ(proposed->second.size(), static_cast<size_t>(step.drafts)) << what;
          EXPECT_EQ(step.accepted, GreedyAccepted(proposed->second, plain[i].ids, generated))
              << what << ", step at output index " << generated;
        }
        generated += step.tokens.size();
        drafts += step.drafts;
        accepted += step.accepted;
        multi_token_steps += step.tokens.size() > 1 ? 1 : 0;
      }
    }
    // Otherwise nothing was speculated and the equality above is plain vs plain.
    EXPECT_GT(accepted, 0) << "N=" << n;
    EXPECT_LT(accepted, drafts) << "N=" << n << ": no draft rejected, no rollback exercised";
    EXPECT_GT(multi_token_steps, 0) << "N=" << n;
  }
}

TEST_F(SpeculativeDecodingTest, ARejectionAtEveryDraftPositionRollsBackToPlainDecoding) {
  constexpr int kDrafts = 4;
  const std::vector<std::vector<int32_t>> prompts = testing::HeldOutPrompts(3);
  for (const std::vector<int32_t>& prompt : prompts) {
    SequenceRequest request = Greedy(prompt, 24);
    request.ignore_eos = true;  // every step full, so every position is reached
    const RunResult plain = Plain(request);
    ASSERT_EQ(plain.ids.size(), 24u);
    for (int wrong = 0; wrong <= kDrafts; ++wrong) {  // kDrafts: every draft right
      OracleDrafter drafter(prompt.size(), plain.ids, wrong, vocab());
      SequenceRunner runner(spec_model_.model.get(), Eos(spec_model_));
      runner.SetDrafter(&drafter, kDrafts);
      std::vector<int64_t> kept;
      runner.SetKeptTokensObserver([&](int64_t k) { kept.push_back(k); });
      absl::StatusOr<RunResult> spec = Generate(runner, request);
      ASSERT_THAT(spec, IsOk());
      ExpectSameOutput(plain, *spec, "draft " + std::to_string(wrong) + " wrong");
      ASSERT_EQ(kept.size(), spec->steps.size());
      for (size_t s = 1; s < spec->steps.size(); ++s) {
        const SequenceStep& step = spec->steps[s];
        EXPECT_EQ(step.accepted, std::min(wrong, step.drafts)) << "step " << s;
        EXPECT_EQ(kept[s], static_cast<int64_t>(step.tokens.size())) << "step " << s;
        if (s + 1 < spec->steps.size()) {
          EXPECT_EQ(step.tokens.size(), static_cast<size_t>(1 + step.accepted)) << "step " << s;
        }
      }
      // The cache holds the prompt and every emitted token but the last: plain decoding's state.
      EXPECT_EQ(spec_model_.model->cache_length(), static_cast<int64_t>(prompt.size() + plain.ids.size()) - 1);
    }
  }
}

TEST_F(SpeculativeDecodingTest, StopTokensAndMaxTokensInsideAnAcceptedRunEndItThere) {
  constexpr int kDrafts = 4;
  const std::vector<int32_t> prompt = testing::HeldOutPrompts(5)[4];
  SequenceRequest free_run = Greedy(prompt, 30);
  free_run.ignore_eos = true;
  const RunResult plain = Plain(free_run);
  ASSERT_EQ(plain.ids.size(), 30u);
  // With every draft right, step 1 emits tokens 1..5, step 2 tokens 6..10: index 7 is inside
  // an accepted run. Stop on the first token whose first occurrence is there or later.
  size_t stop_at = 7;
  while (stop_at < plain.ids.size() &&
         std::find(plain.ids.begin(), plain.ids.begin() + static_cast<std::ptrdiff_t>(stop_at),
                   plain.ids[stop_at]) != plain.ids.begin() + static_cast<std::ptrdiff_t>(stop_at)) {
    ++stop_at;
  }
  ASSERT_LT(stop_at, plain.ids.size() - 1) << "no fresh token to stop on";
  ASSERT_NE(stop_at % (kDrafts + 1), 0u) << "the stop falls on a step boundary; pick another index";

  SequenceRequest stopped = free_run;
  stopped.stop_token_ids = {plain.ids[stop_at]};
  SequenceRequest short_run = free_run;
  short_run.max_tokens = 8;  // ends inside step 2's run too
  for (const SequenceRequest& request : {stopped, short_run}) {
    const RunResult expected = Plain(request);
    OracleDrafter drafter(prompt.size(), plain.ids, /*wrong_position=*/kDrafts, vocab());
    SequenceRunner runner(spec_model_.model.get(), Eos(spec_model_));
    runner.SetDrafter(&drafter, kDrafts);
    absl::StatusOr<RunResult> spec = Generate(runner, request);
    ASSERT_THAT(spec, IsOk());
    ExpectSameOutput(expected, *spec, "stop / max_tokens");
    EXPECT_GT(spec->steps.back().tokens.size(), 1u) << "the run did not end inside a multi-token step";
  }
  EXPECT_EQ(Plain(stopped).ids.size(), stop_at + 1);
  EXPECT_EQ(Plain(stopped).finish, nq::v1::FINISH_REASON_STOP);
  EXPECT_EQ(Plain(short_run).finish, nq::v1::FINISH_REASON_LENGTH);
}

TEST_F(SpeculativeDecodingTest, MtpDraftsMatchATeacherForcedPassOverTheFinalSequence) {
  // If the MTP cache kept a rejected draft's entry, or missed a kept position, its next draft
  // would read the wrong context: the first draft of every step must be what the MTP layer
  // predicts over the whole final sequence in one pass.
  MtpDrafter mtp(spec_model_.model.get());
  RecordingDrafter drafter(&mtp);
  SequenceRunner runner(spec_model_.model.get(), Eos(spec_model_));
  runner.SetDrafter(&drafter, 3);
  const std::vector<int32_t> prompt = testing::HeldOutPrompts(8)[6];
  SequenceRequest request = Greedy(prompt, 48);
  request.ignore_eos = true;
  absl::StatusOr<RunResult> spec = Generate(runner, request);
  ASSERT_THAT(spec, IsOk());

  std::vector<int32_t> sequence = prompt;
  sequence.insert(sequence.end(), spec->ids.begin(), spec->ids.end());
  absl::StatusOr<LoadedModel> fresh = testing::LoadModel(testing::NanoModelDir());
  ASSERT_THAT(fresh, IsOk());
  model::Model& m = *fresh->model;
  const std::span<const int32_t> ids(sequence);
  ASSERT_THAT(m.Forward(ids.first(ids.size() - 1)), IsOk());
  const std::vector<float> hidden = m.last_hidden();
  const size_t entries = ids.size() - 2;
  absl::StatusOr<std::vector<float>> mtp_logits = m.ForwardMtp(
      ids.subspan(1, entries),
      std::span<const float>(hidden).first(entries * static_cast<size_t>(m.config().hidden_size)));
  ASSERT_THAT(mtp_logits, IsOk());
  const size_t V = static_cast<size_t>(vocab());
  ASSERT_GT(drafter.first_drafts.size(), 5u);
  for (const auto& [length, draft] : drafter.first_drafts) {
    // Drafting the token at index `length` reads MTP entry length - 2.
    const std::span<const float> row = std::span<const float>(*mtp_logits).subspan((length - 2) * V, V);
    const int32_t expected = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    EXPECT_EQ(draft, expected) << "draft for index " << length;
  }
}

TEST_F(SpeculativeDecodingTest, SeededSamplingIsReproducibleWithDrafts) {
  MtpDrafter drafter(spec_model_.model.get());
  SequenceRunner runner(spec_model_.model.get(), Eos(spec_model_));
  runner.SetDrafter(&drafter, 3);
  SequenceRequest request = Greedy(testing::HeldOutPrompts(3)[2], 32);
  request.sampling.temperature = 0.8f;
  request.sampling.top_p = 0.95f;
  request.sampling.seed = 1234;
  request.ignore_eos = true;
  absl::StatusOr<RunResult> first = Generate(runner, request);
  absl::StatusOr<RunResult> second = Generate(runner, request);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(first->ids, second->ids);
  int accepted = 0;
  for (const SequenceStep& step : first->steps) accepted += step.accepted;
  EXPECT_GT(accepted, 0) << "no draft accepted: rejection sampling was not exercised";
}

// With drafts drawn and chained on the backend and verification's picks taken from the backend
// (SetDraftOnDevice, SetDeviceSampling: what nq-worker does by default), the drafter proposes at
// every step exactly what it proposes with every draft's logits on the host, every step accepts
// as many, and the output is plain decoding's.
TEST_F(SpeculativeDecodingTest, GreedyDraftsChainedOnTheBackendAreTheHostDrafts) {
  std::vector<std::vector<int32_t>> prompts = testing::HeldOutPrompts(4);
  // Prompts of 1 to 4 tokens draft on the backend from their prefill on.
  for (size_t length = 1; length <= 4; ++length) prompts.emplace_back(prompts[length - 1].begin(), prompts[length - 1].begin() + length);
  for (int n : {1, 3}) {
    std::map<bool, std::vector<std::map<size_t, std::vector<int32_t>>>> drafts_by_mode;
    std::map<bool, std::vector<std::vector<std::pair<int, int>>>> steps_by_mode;  // (drafts, accepted)
    for (bool on_device : {false, true}) {
      MtpDrafter mtp(spec_model_.model.get());
      mtp.SetDraftOnDevice(on_device);
      RecordingDrafter drafter(&mtp);
      SequenceRunner runner(spec_model_.model.get(), Eos(spec_model_));
      runner.SetDrafter(&drafter, n);
      runner.SetDeviceSampling(on_device);
      for (size_t i = 0; i < prompts.size(); ++i) {
        drafter.all_drafts.clear();
        // No log-probabilities: the backend's picks are only taken for requests without them.
        SequenceRequest request = Greedy(prompts[i]);
        request.sampling.top_logprobs = 0;
        request.sampling.logprobs = false;
        absl::StatusOr<RunResult> spec = Generate(runner, request);
        ASSERT_THAT(spec, IsOk());
        const RunResult plain = Plain(Greedy(prompts[i]));
        const std::string what = "N=" + std::to_string(n) + (on_device ? " on the backend" : " on the host");
        EXPECT_EQ(spec->ids, plain.ids) << what;
        EXPECT_EQ(spec->finish, plain.finish) << what;
        drafts_by_mode[on_device].push_back(drafter.all_drafts);
        std::vector<std::pair<int, int>> steps;
        for (const SequenceStep& step : spec->steps) steps.emplace_back(step.drafts, step.accepted);
        steps_by_mode[on_device].push_back(steps);
      }
    }
    EXPECT_EQ(drafts_by_mode[true], drafts_by_mode[false]) << "N=" << n;
    EXPECT_EQ(steps_by_mode[true], steps_by_mode[false]) << "N=" << n;
    size_t proposals = 0, accepted = 0;
    for (const auto& per_prompt : drafts_by_mode[true]) proposals += per_prompt.size();
    for (const auto& per_prompt : steps_by_mode[true]) {
      for (const auto& [drafts, kept] : per_prompt) accepted += static_cast<size_t>(kept);
    }
    EXPECT_GT(proposals, prompts.size()) << "N=" << n << ": hardly anything was drafted";
    EXPECT_GT(accepted, 0u) << "N=" << n;
  }
}

// Model::DraftOnDevice against the host's chain (ForwardMtpLast, the argmax, the last state fed
// back) on two copies of the model: the same drafts, MTP cache length, last state and MTP
// routing, over a first chain and one after rolling the MTP cache back; and its refusals, which
// leave the MTP cache as it was.
TEST_F(SpeculativeDecodingTest, DraftOnDeviceIsTheHostsDraftingChain) {
  model::Model& host = *plain_model_.model;
  model::Model& device = *spec_model_.model;
  host.ResetCache();
  device.ResetCache();
  const std::vector<int32_t> prompt = testing::HeldOutPrompts(2)[1];
  const int64_t D = host.config().hidden_size;
  const size_t V = static_cast<size_t>(vocab());
  ASSERT_THAT(host.Forward(prompt), IsOk());
  ASSERT_THAT(device.Forward(prompt), IsOk());
  const std::vector<float> hidden = host.last_hidden();
  ASSERT_EQ(hidden, device.last_hidden());
  std::vector<std::pair<int64_t, std::vector<int32_t>>> host_routing, device_routing;
  host.SetRoutingObserver([&](int64_t layer, const model::MoeRouting& r) { host_routing.emplace_back(layer, r.experts); });
  device.SetRoutingObserver([&](int64_t layer, const model::MoeRouting& r) { device_routing.emplace_back(layer, r.experts); });
  auto argmax = [](std::span<const float> row) {
    return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
  };
  // The kept entries [first, first + rows): token sequence[j + 1] with the main state at j.
  auto host_chain = [&](size_t first, size_t rows, int drafts) -> std::vector<int32_t> {
    std::vector<int32_t> out;
    const std::span<const int32_t> next(prompt.data() + first + 1, rows);
    absl::StatusOr<std::vector<float>> logits =
        host.ForwardMtpLast(next, std::span<const float>(hidden).subspan(first * D, rows * D));
    EXPECT_THAT(logits, IsOk());
    if (!logits.ok()) return out;
    out.push_back(argmax(*logits));
    while (static_cast<int>(out.size()) < drafts) {
      const std::vector<float> state = host.last_mtp_hidden();
      logits = host.ForwardMtpLast(std::span<const int32_t>(&out.back(), 1),
                                   std::span<const float>(state).last(static_cast<size_t>(D)));
      EXPECT_THAT(logits, IsOk());
      if (!logits.ok()) return out;
      out.push_back(argmax(std::span<const float>(*logits).first(V)));
    }
    return out;
  };
  const kernels::SampleParams greedy{};
  auto device_chain = [&](size_t first, size_t rows, int drafts) {
    return device.DraftOnDevice(std::span<const int32_t>(prompt.data() + first + 1, rows),
                                std::span<const float>(hidden).subspan(first * D, rows * D), drafts, greedy);
  };
  // The prompt's first entries, 4 rows then 3 drafts; then back to entry 6, 2 rows and 4 drafts.
  struct Round {
    size_t truncate_to, first, rows;
    int drafts;
  };
  for (const Round& round : {Round{0, 0, 4, 3}, Round{6, 6, 2, 4}, Round{8, 8, 1, 1}}) {
    ASSERT_THAT(host.TruncateMtpCache(static_cast<int64_t>(round.truncate_to)), IsOk());
    ASSERT_THAT(device.TruncateMtpCache(static_cast<int64_t>(round.truncate_to)), IsOk());
    const std::string what = "round from entry " + std::to_string(round.first);
    const std::vector<int32_t> want = host_chain(round.first, round.rows, round.drafts);
    absl::StatusOr<std::vector<int32_t>> got = device_chain(round.first, round.rows, round.drafts);
    ASSERT_THAT(got, IsOk()) << what;
    EXPECT_EQ(*got, want) << what;
    EXPECT_EQ(device.mtp_cache_length(), host.mtp_cache_length()) << what;
    const std::span<const float> want_state = std::span<const float>(host.last_mtp_hidden()).last(static_cast<size_t>(D));
    ASSERT_EQ(device.last_mtp_hidden().size(), static_cast<size_t>(D)) << what;
    for (int64_t i = 0; i < D; ++i) {
      EXPECT_NEAR(device.last_mtp_hidden()[static_cast<size_t>(i)], want_state[static_cast<size_t>(i)], 1e-5) << what;
    }
    EXPECT_EQ(device_routing, host_routing) << what;
    EXPECT_FALSE(device_routing.empty()) << what;
  }

  // An observer of the decoder's layers only (a worker's) sees no MTP forward, and still every
  // main layer of a main forward.
  std::vector<int64_t> observed_layers;
  device.SetRoutingObserver([&](int64_t layer, const model::MoeRouting&) { observed_layers.push_back(layer); },
                            /*mtp_layers=*/false);
  ASSERT_THAT(device.TruncateMtpCache(8), IsOk());
  ASSERT_THAT(device_chain(8, 2, 3), IsOk());
  EXPECT_TRUE(observed_layers.empty()) << observed_layers.size() << " MTP routings observed";
  ASSERT_THAT(device.Forward(std::span<const int32_t>(prompt).first(1)), IsOk());
  EXPECT_FALSE(observed_layers.empty());
  for (int64_t layer : observed_layers) EXPECT_LT(layer, device.config().num_hidden_layers);
  device.SetRoutingObserver([&](int64_t layer, const model::MoeRouting& r) { device_routing.emplace_back(layer, r.experts); });

  // Refusals: nothing runs and the MTP cache keeps its length.
  const int64_t length = device.mtp_cache_length();
  const std::span<const float> one_state = std::span<const float>(hidden).first(static_cast<size_t>(D));
  const std::vector<int32_t> one_token = {prompt[1]};
  EXPECT_EQ(device_chain(0, 1, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(device_chain(0, 1, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(device_chain(0, 5, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(device.DraftOnDevice(one_token, one_state, 2, greedy, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);  // no second MTP layer
  EXPECT_EQ(device.DraftOnDevice(one_token, one_state.first(static_cast<size_t>(D - 1)), 2, greedy).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> outside = {static_cast<int32_t>(vocab())};
  EXPECT_EQ(device.DraftOnDevice(outside, one_state, 2, greedy).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device.mtp_cache_length(), length);
  host.SetRoutingObserver(nullptr);
  device.SetRoutingObserver(nullptr);
  host.ResetCache();
  device.ResetCache();
}

// A follower of a tensor-parallel group runs the leader's greedy draft chain from its command
// (StepCommand::Op::kDraftOnDevice, through the wire format): its MTP cache and last state end as
// the leader's own DraftOnDevice leaves them. A command for another MTP position, or for hidden
// rows past the follower's last forward, is refused by name and runs nothing.
TEST_F(SpeculativeDecodingTest, AFollowersDraftChainCommandRunsTheLeadersChain) {
  model::Model& leader = *plain_model_.model;
  model::Model& follower = *spec_model_.model;
  for (model::Model* m : {&leader, &follower}) {
    m->ResetCache();
    ASSERT_THAT(m->TruncateMtpCache(0), IsOk());
  }
  const std::vector<int32_t> prompt = testing::HeldOutPrompts(3)[2];
  ASSERT_GE(prompt.size(), 4u);
  const std::span<const int32_t> forward(prompt.data(), 3), next(prompt.data() + 1, 3);
  ASSERT_THAT(leader.Forward(forward), IsOk());
  ASSERT_THAT(follower.Forward(forward), IsOk());
  ASSERT_THAT(leader.DraftOnDevice(next, leader.last_hidden(), 3, kernels::SampleParams{}), IsOk());

  StepCommand sent{.op = StepCommand::Op::kDraftOnDevice, .position = 0, .hidden_row = 0, .num_drafts = 3};
  sent.tokens.assign(next.begin(), next.end());
  absl::StatusOr<StepCommand> command = DecodeStepHeader(EncodeStepHeader(sent), 64);
  ASSERT_THAT(command, IsOk());
  ASSERT_THAT(DecodeStepPayload(EncodeStepPayload(sent), *command), IsOk());
  ASSERT_THAT(ApplyStepCommand(*command, follower), IsOk());
  EXPECT_EQ(follower.mtp_cache_length(), 3 + 3 - 1);
  EXPECT_EQ(follower.mtp_cache_length(), leader.mtp_cache_length());
  EXPECT_EQ(follower.last_mtp_hidden(), leader.last_mtp_hidden());

  const int64_t length = follower.mtp_cache_length();
  EXPECT_THAT(ApplyStepCommand(*command, follower),  // position 0 again: the cache has moved on
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("MTP cache holds 5 positions")));
  StepCommand past = *command;
  past.position = length;
  past.hidden_row = 1;  // rows [1, 4) of a 3-row forward
  EXPECT_THAT(ApplyStepCommand(past, follower),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("past the 3 rows")));
  EXPECT_EQ(follower.mtp_cache_length(), length);
  for (model::Model* m : {&leader, &follower}) {
    m->ResetCache();
    ASSERT_THAT(m->TruncateMtpCache(0), IsOk());
  }
}

}  // namespace
}  // namespace nq::worker
