// Speculative decoding of sampled requests where the step graphs sample (issue #13's device
// sampling with issue #15's drafts), on the embedded default served from its release (CPU): its
// experts route on the backend, so with ModelOptions::uncaptured_step_graphs the CPU runs the
// graph body a GPU would capture (the drafts' chain, the verification rows' draws).
#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "services/release/release_experts.h"
#include "services/worker/decode_bench.h"
#include "services/worker/mtp_drafter.h"
#include "services/worker/sequence_runner.h"
#include "tests/common/embedded_model.h"
#include "tests/common/status_matchers.h"
#include "tests/worker/nano_model.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;

// Proposes nothing: a runner with a drafter set draws its tokens keyed by position
// (SamplingConfig::position_keyed_draws) but decodes plainly, one token a step.
class NoDrafter final : public Drafter {
 public:
  absl::Status BeginSequence(const SamplingConfig&) override { return absl::OkStatus(); }
  int64_t CoveredPositions() const override { return std::numeric_limits<int64_t>::max(); }
  absl::StatusOr<Drafts> Propose(const DraftRequest&) override { return Drafts{}; }
};

// Counts the drafts the MTP drafter proposes and whether any came with a draft distribution.
class CountingDrafter final : public Drafter {
 public:
  explicit CountingDrafter(Drafter* inner) : inner_(inner) {}
  absl::Status BeginSequence(const SamplingConfig& s) override { return inner_->BeginSequence(s); }
  int64_t CoveredPositions() const override { return inner_->CoveredPositions(); }
  absl::StatusOr<Drafts> Propose(const DraftRequest& r) override {
    absl::StatusOr<Drafts> drafts = inner_->Propose(r);
    if (drafts.ok()) {
      proposed += static_cast<int>(drafts->tokens.size());
      with_distributions += static_cast<int>(drafts->probs.size());
    }
    return drafts;
  }
  int proposed = 0;
  int with_distributions = 0;

 private:
  Drafter* const inner_;
};

class SampledSpeculationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_NO_FATAL_FAILURE(
        nq::testing::PrepareEmbeddedModelOnCpu(NQ_TOOL_BIN, NQ_SOURCE_DIR, NQ_EMBEDDED_MODEL_DIR, &backend_));
    for (release::ServedModel* served : {&spec_, &plain_}) {
      absl::StatusOr<release::ServedModel> loaded = release::LoadServedModel(
          NQ_EMBEDDED_MODEL_DIR, std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", release::ExpertBits::k2Bit,
          *backend_, nullptr, {.max_tokens = 1024, .uncaptured_step_graphs = true});
      ASSERT_THAT(loaded, IsOk());
      *served = *std::move(loaded);
    }
    ASSERT_TRUE(spec_.model->has_mtp());
  }
  static void TearDownTestSuite() {
    spec_ = {};
    plain_ = {};
    delete backend_;
  }
  static kernels::Backend* backend_;
  static release::ServedModel spec_;
  static release::ServedModel plain_;
};
kernels::Backend* SampledSpeculationTest::backend_ = nullptr;
release::ServedModel SampledSpeculationTest::spec_;
release::ServedModel SampledSpeculationTest::plain_;

// The sampled requests both tests run: 3 prompts x 3 settings, 40 tokens each, ignoring EOS.
std::vector<SequenceRequest> SampledRequests() {
  std::vector<SequenceRequest> requests;
  for (const std::vector<int32_t>& prompt : testing::HeldOutPrompts(3)) {
    for (const SamplingConfig& sampling : std::vector<SamplingConfig>{
             {.temperature = 0.8f, .top_p = 0.95f, .seed = 41, .logprobs = false},
             {.temperature = 0.5f, .top_k = 20, .seed = 42, .logprobs = false},
             {.temperature = 1.0f, .seed = 43, .logprobs = false}}) {
      SequenceRequest request;
      request.prompt = prompt;
      request.sampling = sampling;
      request.max_tokens = 40;
      request.ignore_eos = true;
      requests.push_back(std::move(request));
    }
  }
  return requests;
}

// Drafts verified and accepted over a run's steps, and the steps that rejected one.
struct Acceptance {
  int verified = 0, accepted = 0, rejections = 0;
  void Add(const testing::RunResult& run) {
    for (const SequenceStep& step : run.steps) {
      verified += step.drafts;
      accepted += step.accepted;
      if (step.drafts > step.accepted) ++rejections;
    }
  }
  double rate() const { return static_cast<double>(accepted) / std::max(1, verified); }
};

// The two runners the tests compare: 3 MTP drafts a step as nq-worker runs them (drafted on the
// backend, device sampling on), and plain decoding with the same keyed draws (NoDrafter).
struct Runners {
  explicit Runners(const release::ServedModel& spec_model, const release::ServedModel& plain_model)
      : mtp(spec_model.model.get()),
        drafter(&mtp),
        spec(spec_model.model.get(), Eos(spec_model)),
        plain(plain_model.model.get(), Eos(plain_model)) {
    mtp.SetDraftOnDevice(true);
    spec.SetDrafter(&drafter, 3);
    spec.SetDeviceSampling(true);
    plain.SetDrafter(&none, 3);
    plain.SetDeviceSampling(true);
  }
  static std::vector<int32_t> Eos(const release::ServedModel& m) {
    return {m.model->config().eos_token_ids.begin(), m.model->config().eos_token_ids.end()};
  }
  MtpDrafter mtp;
  CountingDrafter drafter;
  NoDrafter none;
  SequenceRunner spec;
  SequenceRunner plain;
};

// A sampled request drafts greedily on the backend and each verification row takes its own
// position's draw there (Sampler::DeviceDraws): the output is plain sampling with the same keyed
// draws, token for token, whether a step's drafts are accepted or not, and no draft distribution
// comes to the host. (On a backend without step graphs the drafts stay the host's draws, verified
// by rejection sampling with their distributions: SpeculativeDecodingTest.SeededSampling...)
TEST_F(SampledSpeculationTest, DraftsAndVerificationOnTheBackendGivePlainKeyedSampling) {
  ASSERT_TRUE(spec_.model->SamplesOnDevice(4)) << "the step graphs do not apply: the test would run the host's path";
  Runners r(spec_, plain_);
  Acceptance device;
  for (const SequenceRequest& request : SampledRequests()) {
    absl::StatusOr<testing::RunResult> got = testing::Generate(r.spec, request);
    absl::StatusOr<testing::RunResult> want = testing::Generate(r.plain, request);
    ASSERT_THAT(got, IsOk());
    ASSERT_THAT(want, IsOk());
    EXPECT_EQ(got->ids, want->ids) << "temperature " << request.sampling.temperature;
    device.Add(*got);
  }
  EXPECT_EQ(r.drafter.with_distributions, 0) << "a draft distribution came to the host";
  EXPECT_GT(r.drafter.proposed, 30) << "hardly anything was drafted";
  EXPECT_GT(device.verified, 30);
  EXPECT_GT(device.accepted, 0) << "no draft accepted";
  EXPECT_GT(device.rejections, 0) << "no rejection: the rows after a rejected draft were not exercised";

  // What the greedy drafts cost in acceptance: the same requests with the host's sampled drafts
  // and rejection sampling (device sampling off, as a backend without step graphs runs them).
  MtpDrafter host_mtp(spec_.model.get());
  SequenceRunner host(spec_.model.get(), Runners::Eos(spec_));
  host.SetDrafter(&host_mtp, 3);
  Acceptance on_host;
  for (const SequenceRequest& request : SampledRequests()) {
    absl::StatusOr<testing::RunResult> run = testing::Generate(host, request);
    ASSERT_THAT(run, IsOk());
    on_host.Add(*run);
  }
  std::printf("[ measure  ] drafts accepted: greedy drafts, rows drawn on the backend %d / %d (%.3f); "
              "sampled drafts, rejection sampling on the host %d / %d (%.3f)\n",
              device.accepted, device.verified, device.rate(), on_host.accepted, on_host.verified, on_host.rate());
}

// Each block's residual added in the next norm's op (ModelOptions::fused_residual_norm, the
// default): the same tokens as the Adds of their own, with MTP drafts and without, on the
// step-graph body with the MoE blocks' routed and shared outputs pending together (the packed
// experts route on the backend).
TEST_F(SampledSpeculationTest, ResidualsAddedInTheNormDecodeTheSameTokens) {
  // [0]: the drafting runner's, [1]: the plain one's.
  release::ServedModel fused[2], separate[2];
  for (bool in_norm : {true, false}) {
    for (release::ServedModel& served : in_norm ? fused : separate) {
      absl::StatusOr<release::ServedModel> loaded = release::LoadServedModel(
          NQ_EMBEDDED_MODEL_DIR, std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", release::ExpertBits::k2Bit,
          *backend_, nullptr, {.max_tokens = 1024, .fused_residual_norm = in_norm, .uncaptured_step_graphs = true});
      ASSERT_THAT(loaded, IsOk());
      served = *std::move(loaded);
    }
  }
  ASSERT_TRUE(fused[1].model->SamplesOnDevice(4));
  Runners before(separate[0], separate[1]);
  Runners in_norm(fused[0], fused[1]);
  std::vector<SequenceRequest> requests = SampledRequests();
  requests.resize(3);
  requests[0].sampling = {.temperature = 0, .logprobs = false};  // greedy
  for (const SequenceRequest& request : requests) {
    for (auto [runner, reference] : {std::pair(&in_norm.plain, &before.plain), std::pair(&in_norm.spec, &before.spec)}) {
      absl::StatusOr<testing::RunResult> got = testing::Generate(*runner, request);
      absl::StatusOr<testing::RunResult> want = testing::Generate(*reference, request);
      ASSERT_THAT(got, IsOk());
      ASSERT_THAT(want, IsOk());
      EXPECT_EQ(got->ids, want->ids) << "temperature " << request.sampling.temperature;
    }
  }
  EXPECT_GT(in_norm.drafter.proposed, 0);
}

// bench-decode's host timers (Model::StepGraphStats): every timed step that runs as a step
// graph is counted, with its launch-and-wait time and the host's time on either side of it; a
// model whose steps do not run as graphs reports none.
TEST_F(SampledSpeculationTest, DecodeBenchTimesTheHostAroundEachGraphedStep) {
  const DecodeBenchOptions options{.prompt_tokens = 16, .warmup_tokens = 2, .decode_tokens = 8, .seed = 3};
  absl::StatusOr<DecodeBenchReport> report = RunDecodeBench(*plain_.model, options);
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->graphed_steps, 8);
  EXPECT_GT(report->launch_and_wait_us, 0);
  EXPECT_GE(report->host_before_launch_us, 0);
  EXPECT_GE(report->host_after_wait_us, 0);
  double step_us = 0;
  for (double seconds : report->step_seconds) step_us += seconds * 1e6 / 8;
  EXPECT_LE(report->host_before_launch_us + report->launch_and_wait_us + report->host_after_wait_us, step_us)
      << "the forward's parts exceed the whole step";
  DecodeBenchSetup setup;
  setup.model = "nano";
  EXPECT_THAT(DecodeBenchSummary(setup, *report), ::testing::HasSubstr("us before each graph's launch"));

  // The CPU backend cannot capture, and without uncaptured_step_graphs its steps run op by op.
  absl::StatusOr<testing::LoadedModel> op_by_op = testing::LoadModel(NQ_EMBEDDED_MODEL_DIR, 64);
  ASSERT_THAT(op_by_op, IsOk());
  absl::StatusOr<DecodeBenchReport> ungraphed = RunDecodeBench(*op_by_op->model, options);
  ASSERT_THAT(ungraphed, IsOk());
  EXPECT_EQ(ungraphed->graphed_steps, 0);
  EXPECT_THAT(DecodeBenchSummary(setup, *ungraphed),
              ::testing::Not(::testing::HasSubstr("graph's launch")));
}

// A request whose draws the backend cannot make (log-probabilities asked for) still drafts
// greedily on the backend, and its rows come to the host, where Sampler::Verify of a
// deterministic draft makes the same keyed draws: the same tokens and log-probabilities as plain
// sampling on the host.
TEST_F(SampledSpeculationTest, RequestsWithLogprobsVerifyOnTheHostWithTheSameDraws) {
  Runners r(spec_, plain_);
  SequenceRequest request;
  request.prompt = testing::HeldOutPrompts(2)[1];
  request.sampling = {.temperature = 0.8f, .seed = 44, .top_logprobs = 2};
  request.max_tokens = 32;
  request.ignore_eos = true;
  absl::StatusOr<testing::RunResult> got = testing::Generate(r.spec, request);
  absl::StatusOr<testing::RunResult> want = testing::Generate(r.plain, request);
  ASSERT_THAT(got, IsOk());
  ASSERT_THAT(want, IsOk());
  EXPECT_EQ(got->ids, want->ids);
  EXPECT_EQ(got->logprobs, want->logprobs);
  EXPECT_GT(r.drafter.proposed, 0);
  EXPECT_EQ(r.drafter.with_distributions, 0);
}

// Requests with logit_bias or presence / frequency penalties (no log-probabilities) draw in the
// step graph too when device logit adjustment is on: the graph adds the request's delta row to
// the logits before its draw. Their tokens equal the host Sampler's, greedy and seeded; a bias
// that forces one id shows the row really was adjusted there.
TEST_F(SampledSpeculationTest, BiasAndPenaltyRequestsDrawInTheGraphAsTheHostDoes) {
  ASSERT_TRUE(plain_.model->SamplesOnDevice(1));
  SequenceRunner device(plain_.model.get(), Runners::Eos(plain_));
  device.SetDeviceSampling(true);
  device.SetDeviceLogitAdjust(true);
  SequenceRunner host(plain_.model.get(), Runners::Eos(plain_));
  const std::vector<int32_t> prompt = testing::HeldOutPrompts(1)[0];
  const std::vector<SamplingConfig> settings = {
      {.temperature = 0, .logprobs = false, .frequency_penalty = 1.5f},
      {.temperature = 0, .logprobs = false, .presence_penalty = 2.0f, .logit_bias = {{11, 2.5f}, {12, -3.0f}}},
      {.temperature = 0.8f, .top_p = 0.95f, .seed = 45, .logprobs = false, .frequency_penalty = 0.8f},
      {.temperature = 1.0f, .seed = 46, .logprobs = false, .presence_penalty = -0.5f, .logit_bias = {{20, 1.5f}}},
  };
  for (const SamplingConfig& sampling : settings) {
    SequenceRequest request;
    request.prompt = prompt;
    request.sampling = sampling;
    request.max_tokens = 24;
    request.ignore_eos = true;
    absl::StatusOr<testing::RunResult> got = testing::Generate(device, request);
    absl::StatusOr<testing::RunResult> want = testing::Generate(host, request);
    ASSERT_THAT(got, IsOk());
    ASSERT_THAT(want, IsOk());
    EXPECT_EQ(got->ids, want->ids) << "temperature " << sampling.temperature;
  }
  SequenceRequest forced;
  forced.prompt = prompt;
  forced.sampling = {.temperature = 0, .logprobs = false, .logit_bias = {{33, 100.0f}}};
  forced.max_tokens = 8;
  forced.ignore_eos = true;
  absl::StatusOr<testing::RunResult> run = testing::Generate(device, forced);
  ASSERT_THAT(run, IsOk());
  EXPECT_THAT(run->ids, ::testing::Each(33));
}

// Draws for a verification must be one for every row, or one for all: anything else is refused
// before a forward runs (the cache keeps its length), on the graph path and without it.
TEST_F(SampledSpeculationTest, ForwardSampledRowsRefusesADrawCountThatIsNotTheRows) {
  const std::vector<int32_t> tokens = {5, 6, 7};
  const std::vector<kernels::SampleParams> two(2);
  for (model::Model* model : {spec_.model.get(), plain_.model.get()}) {
    model->ResetCache();
    EXPECT_THAT(model->ForwardSampledRows(tokens, two),
                ::nq::testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("2 draws for 3 tokens")));
    EXPECT_THAT(model->ForwardSampledRows(tokens, {}),
                ::nq::testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("0 draws for 3 tokens")));
    EXPECT_EQ(model->cache_length(), 0);
  }
}

}  // namespace
}  // namespace nq::worker
