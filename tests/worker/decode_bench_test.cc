// nq bench-decode on glm5_nano (CPU): the benchmark decodes what the model decodes (its timed
// tokens equal a greedy argmax loop over Model::Forward written here), it counts the context
// window as the worker does (a run that exactly fills it runs; one more token is refused, naming
// the numbers), and the `nq` command writes that report, for the checkpoint and for a release
// encoded here (nq encode of glm5_nano takes about a second on 2 cores).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "services/release/release_encoder.h"
#include "services/release/release_experts.h"
#include "services/worker/arena_geometry.h"
#include "services/worker/decode_bench.h"
#include "services/worker/worker_mailbox.h"
#include "tests/common/run_shell.h"
#include "tests/common/status_matchers.h"
#include "tests/worker/nano_model.h"

namespace nq::worker {
namespace {

namespace fs = std::filesystem;
using ::nq::testing::CommandResult;
using ::nq::testing::IsOk;
using ::nq::testing::RunShell;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using testing::LoadedModel;
using testing::NanoModelDir;

// The first maximum: the sampler's greedy rule (ties to the lower id).
int32_t Argmax(const std::vector<float>& row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Greedy decoding by hand: prefill `prompt`, then feed each argmax back one token at a time.
// Returns the tokens of the last `timed` of `warmup + timed` decode steps.
std::vector<int32_t> ReferenceTokens(model::Model& model, const std::vector<int32_t>& prompt, int64_t warmup,
                                     int64_t timed) {
  model.ResetCache();
  absl::StatusOr<std::vector<float>> logits = model.ForwardLast(prompt);
  EXPECT_THAT(logits, IsOk());
  if (!logits.ok()) return {};
  int32_t token = Argmax(*logits);
  std::vector<int32_t> tokens;
  for (int64_t step = 0; step < warmup + timed; ++step) {
    logits = model.Forward(std::span<const int32_t>(&token, 1));
    EXPECT_THAT(logits, IsOk());
    if (!logits.ok()) return {};
    token = Argmax(*logits);
    if (step >= warmup) tokens.push_back(token);
  }
  return tokens;
}

TEST(DecodeBenchTest, TimedTokensAreTheModelsGreedyTokens) {
  absl::StatusOr<LoadedModel> loaded = testing::LoadModel(NanoModelDir(), 256);
  ASSERT_THAT(loaded, IsOk());
  model::Model& model = *loaded->model;
  const DecodeBenchOptions options{.prompt_tokens = 48, .warmup_tokens = 3, .decode_tokens = 16, .seed = 7};
  absl::StatusOr<DecodeBenchReport> report = RunDecodeBench(model, options);
  ASSERT_THAT(report, IsOk());
  ASSERT_EQ(report->tokens.size(), 16u);
  ASSERT_EQ(report->step_seconds.size(), 16u);
  // The sequence continued from the prompt: every step appended to one cache.
  EXPECT_EQ(model.cache_length(), 48 + 3 + 16);
  EXPECT_GT(report->prefill_seconds, 0);
  for (double s : report->step_seconds) EXPECT_GT(s, 0);
  EXPECT_GT(report->tokens_per_second(), 0);

  const std::vector<int32_t> prompt = DecodeBenchPrompt(48, model.config().vocab_size, 7);
  EXPECT_EQ(ReferenceTokens(model, prompt, 3, 16), report->tokens);
}

// With MTP drafts (--speculative_tokens) a step emits 1 + its accepted drafts: greedy output is
// still the model's greedy tokens, the timed tokens are the last ones of the sequence (a step
// that starts inside the warm-up is not timed), and tokens/s counts every token a step emits.
TEST(DecodeBenchTest, WithDraftsTheTimedTokensAreTheGreedySequencesLast) {
  absl::StatusOr<LoadedModel> loaded = testing::LoadModel(NanoModelDir(), 256);
  ASSERT_THAT(loaded, IsOk());
  model::Model& model = *loaded->model;
  ASSERT_TRUE(model.has_mtp());
  const DecodeBenchOptions options{
      .prompt_tokens = 48, .warmup_tokens = 3, .decode_tokens = 24, .seed = 7, .speculative_tokens = 3};
  absl::StatusOr<DecodeBenchReport> report = RunDecodeBench(model, options);
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(model.cache_length(), 48 + 3 + 24);
  int emitted = 0;
  for (int n : report->step_tokens) emitted += n;
  ASSERT_EQ(static_cast<size_t>(emitted), report->tokens.size());
  ASSERT_EQ(report->step_tokens.size(), report->step_seconds.size());
  EXPECT_LT(report->step_seconds.size(), report->tokens.size()) << "no step kept a draft";
  EXPECT_GT(report->drafts_verified, 0);
  EXPECT_GT(report->drafts_accepted, 0);
  EXPECT_TRUE(report->step_bytes.empty());
  double seconds = 0;
  for (double s : report->step_seconds) seconds += s;
  EXPECT_DOUBLE_EQ(report->tokens_per_second(), emitted / seconds);
  const std::vector<int32_t> all =
      ReferenceTokens(model, DecodeBenchPrompt(48, model.config().vocab_size, 7), 0, 3 + 24);
  ASSERT_LE(report->tokens.size(), all.size());
  EXPECT_EQ(std::vector<int32_t>(all.end() - static_cast<std::ptrdiff_t>(report->tokens.size()), all.end()),
            report->tokens);
  const std::string summary = DecodeBenchSummary({.model = "nano", .device = "cpu"}, *report);
  EXPECT_THAT(summary, HasSubstr("3 MTP drafts a step"));
  EXPECT_THAT(summary, HasSubstr("ms/step p50"));
}

TEST(DecodeBenchTest, PromptIsDeterministicAndInsideTheVocabulary) {
  const std::vector<int32_t> a = DecodeBenchPrompt(500, 8192, 1);
  EXPECT_EQ(a, DecodeBenchPrompt(500, 8192, 1));
  EXPECT_NE(a, DecodeBenchPrompt(500, 8192, 2));
  ASSERT_EQ(a.size(), 500u);
  for (int32_t id : a) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 8192);
  }
  // Spread over the vocabulary, not a few ids repeated: 500 draws from 8192 repeat about 15.
  std::vector<int32_t> distinct = a;
  std::sort(distinct.begin(), distinct.end());
  EXPECT_GT(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 400);
}

TEST(DecodeBenchTest, RunThatFillsTheWindowRunsAndOneMoreTokenIsRefused) {
  absl::StatusOr<LoadedModel> loaded = testing::LoadModel(NanoModelDir(), 64);
  ASSERT_THAT(loaded, IsOk());
  // 40 + 1 + 3 + 20 = 64: prompt plus completion exactly fill the window.
  absl::StatusOr<DecodeBenchReport> full =
      RunDecodeBench(*loaded->model, {.prompt_tokens = 40, .warmup_tokens = 3, .decode_tokens = 20, .seed = 0});
  ASSERT_THAT(full, IsOk());
  EXPECT_EQ(full->tokens.size(), 20u);
  EXPECT_THAT(
      RunDecodeBench(*loaded->model, {.prompt_tokens = 40, .warmup_tokens = 3, .decode_tokens = 21, .seed = 0}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("40 prompt tokens + 1 from the prefill + 3 warm-up + 21 decode tokens = 65 tokens exceed "
                         "the context window of 64")));
  EXPECT_THAT(CheckDecodeBench({.prompt_tokens = 0, .warmup_tokens = 0, .decode_tokens = 1, .seed = 0}, 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 1 prompt token")));
  EXPECT_THAT(CheckDecodeBench({.prompt_tokens = 1, .warmup_tokens = 0, .decode_tokens = 0, .seed = 0}, 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 1 decode step")));
  EXPECT_THAT(CheckDecodeBench(
                  {.prompt_tokens = 4, .warmup_tokens = 0, .decode_tokens = 4, .seed = 0, .speculative_tokens = -1}, 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("speculative tokens -1 < 0")));
}

// Drafts need an MTP layer: glm5_nano with num_nextn_predict_layers 0 in its config is refused
// before anything runs, and decodes plainly without drafts.
TEST(DecodeBenchTest, DraftsWithoutAnMtpLayerAreRefused) {
  const fs::path dir = fs::path(::testing::TempDir()) / "nano_without_mtp";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const fs::directory_entry& e : fs::directory_iterator(NanoModelDir())) {
    if (e.is_regular_file() && e.path().filename() != "config.json") fs::create_symlink(e.path(), dir / e.path().filename());
  }
  std::ifstream in(fs::path(NanoModelDir()) / "config.json");
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(config.is_discarded());
  config["num_nextn_predict_layers"] = 0;
  std::ofstream(dir / "config.json") << config.dump(2);
  absl::StatusOr<LoadedModel> loaded = testing::LoadModel(dir.string(), 128);
  ASSERT_THAT(loaded, IsOk());
  ASSERT_FALSE(loaded->model->has_mtp());
  EXPECT_THAT(RunDecodeBench(*loaded->model,
                             {.prompt_tokens = 8, .warmup_tokens = 1, .decode_tokens = 4, .seed = 0, .speculative_tokens = 3}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("3 speculative tokens need an MTP layer")));
  EXPECT_THAT(RunDecodeBench(*loaded->model, {.prompt_tokens = 8, .warmup_tokens = 1, .decode_tokens = 4, .seed = 0}),
              IsOk());
}

TEST(DecodeBenchTest, PercentilesAreNearestRank) {
  DecodeBenchReport report;
  report.step_seconds = {0.004, 0.001, 0.003, 0.002, 0.010};
  report.tokens = {1, 2, 3, 4, 5};
  report.options.decode_tokens = 5;
  EXPECT_DOUBLE_EQ(report.StepMillisecondsAt(0.5), 3.0);
  EXPECT_DOUBLE_EQ(report.StepMillisecondsAt(0.9), 10.0);
  EXPECT_DOUBLE_EQ(report.decode_seconds(), 0.020);
  EXPECT_DOUBLE_EQ(report.tokens_per_second(), 250.0);
  const nlohmann::ordered_json json = DecodeBenchJson({.model = "m", .release = "", .expert_bits = "fixed",
                                                       .backend = "cpu", .device = "cpu (2 threads)",
                                                       .kv_cache_dtype = "f32", .max_model_len = 64},
                                                      report);
  EXPECT_EQ(json["expert_bits"], "");  // no release, no bits
  EXPECT_FALSE(json.contains("gpu"));
  EXPECT_EQ(json["step_ms"].size(), 5u);
  EXPECT_DOUBLE_EQ(json["ms_per_token_p90"].get<double>(), 10.0);
}

// ---- the `nq bench-decode` command ----

CommandResult RunNqCommand(const std::string& command, const std::string& args) {
  return RunShell(absl::StrCat(NQ_TOOL_BIN, " ", command, " ", args));
}
CommandResult RunNq(const std::string& args) { return RunNqCommand("bench-decode", args); }

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

class BenchDecodeCommandTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::temp_directory_path() / absl::StrCat("nq-bench-decode-test-", getpid()));
    fs::remove_all(*root_);
    fs::create_directories(*root_);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  // glm5_nano's release, encoded once for the suite.
  static std::string Release() {
    const std::string dir = (*root_ / "release").string();
    if (!fs::exists(fs::path(dir) / "COMPLETE")) {
      release::EncodeReleaseOptions options;
      options.fixed_per_layer = 4;
      EXPECT_THAT(release::EncodeRelease(NanoModelDir(), dir, options), IsOk());
    }
    return dir;
  }

  static fs::path* root_;
};
fs::path* BenchDecodeCommandTest::root_ = nullptr;

// The predictor's salience norms (issue #21) of a decode step's few tokens come from the device
// (the diagonal of xn xnᵀ, copied out with the routing); a longer forward's from the host. Both
// must be each token's squared input norm: token t's xn does not depend on the tokens after it, so
// a 4-token forward and 1-token step report what a 5-token forward reports for the same tokens.
TEST_F(BenchDecodeCommandTest, DecodeStepsReportTheInputNormsTheHostComputes) {
  const std::string release = Release();
  // The stepped model's backend: the CPU here; NQ_STEPPED_BACKEND=cuda on a GPU machine (the
  // device scripts), where its norms come from the GEMV on the device and the oracle stays on
  // the host.
  const char* stepped_name = std::getenv("NQ_STEPPED_BACKEND");
  const std::string stepped_backend = stepped_name != nullptr ? stepped_name : "cpu";
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<kernels::Backend>> device =
      stepped_backend == "cpu" ? kernels::CreateBackend("cpu") : kernels::CreateBackend(stepped_backend);
  ASSERT_THAT(device, IsOk());
  auto load = [&](kernels::Backend& on) {
    return release::LoadModelWithRelease(NanoModelDir(), release, release::ExpertBits::kFixedSet, on, nullptr,
                                         {.max_tokens = 64, .tp = {}});
  };
  absl::StatusOr<std::unique_ptr<model::Model>> whole = load(**backend);
  absl::StatusOr<std::unique_ptr<model::Model>> stepped = load(**device);
  // fp32 on the host; the device's own rounding (its GEMV sums in another order) beside it.
  const double tolerance = stepped_backend == "cpu" ? 1e-5 : 1e-3;
  ASSERT_THAT(whole, IsOk());
  ASSERT_THAT(stepped, IsOk());
  const std::vector<int32_t> tokens = DecodeBenchPrompt(5, (*whole)->config().vocab_size, 9);
  std::map<int64_t, std::vector<float>> want, got;
  (*whole)->SetRoutingObserver([&](int64_t layer, const model::MoeRouting& r) { want[layer] = r.input_sq_norms; });
  ASSERT_THAT((*whole)->Forward(tokens), IsOk());
  (*stepped)->SetRoutingObserver([&](int64_t layer, const model::MoeRouting& r) {
    got[layer].insert(got[layer].end(), r.input_sq_norms.begin(), r.input_sq_norms.end());
  });
  ASSERT_THAT((*stepped)->Forward(std::span<const int32_t>(tokens).first(4)), IsOk());
  ASSERT_THAT((*stepped)->Forward(std::span<const int32_t>(tokens).last(1)), IsOk());
  ASSERT_FALSE(want.empty());
  for (const auto& [layer, norms] : want) {
    ASSERT_EQ(norms.size(), 5u) << "layer " << layer;
    ASSERT_EQ(got[layer].size(), 5u) << "layer " << layer;
    for (size_t t = 0; t < norms.size(); ++t) {
      EXPECT_GT(norms[t], 0.0f);
      EXPECT_NEAR(got[layer][t], norms[t], tolerance * norms[t]) << "layer " << layer << " token " << t;
    }
  }
}

// The slot mailbox decides the bits of every forward (Model::SetSlotMailbox), captured decode steps
// included: with nothing posted a model whose every residual sits in its records runs as the
// all-2-bit model does, and once every expert is posted to its record it runs as the all-4-bit
// model, the same step graphs replayed (nothing is captured again between the two sequences).
// NQ_STEPPED_BACKEND=cuda on a GPU machine runs it over host memory mapped into the device.
TEST_F(BenchDecodeCommandTest, ASlotMailboxDecidesTheBitsOfEveryForwardInsideCapturedSteps) {
  const std::string release = Release();
  const char* stepped_name = std::getenv("NQ_STEPPED_BACKEND");
  const std::string name = stepped_name != nullptr ? stepped_name : "cpu";
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend(name);
  ASSERT_THAT(backend, IsOk());
  auto load = [&](release::ExpertBits bits) {
    return release::LoadModelWithRelease(NanoModelDir(), release, bits, **backend, nullptr,
                                         {.max_tokens = 64, .tp = {}});
  };
  absl::StatusOr<std::unique_ptr<model::Model>> two = load(release::ExpertBits::k2Bit);
  absl::StatusOr<std::unique_ptr<model::Model>> four = load(release::ExpertBits::k4Bit);
  absl::StatusOr<std::unique_ptr<model::Model>> mailed = load(release::ExpertBits::k4Bit);
  ASSERT_THAT(two, IsOk());
  ASSERT_THAT(four, IsOk());
  ASSERT_THAT(mailed, IsOk());
  const model::ModelConfig& config = (*mailed)->config();
  const std::vector<uint32_t> layers = DecodeMoeLayers(config);
  const auto experts = static_cast<uint32_t>(config.n_routed_experts);
  absl::StatusOr<std::unique_ptr<WorkerMailbox>> mailbox = WorkerMailbox::Create(
      SlotGeometry::Packed(layers, experts, 4096, experts, 0), 0, name == "cuda" ? std::optional<int>(0) : std::nullopt);
  ASSERT_THAT(mailbox, IsOk());
  ASSERT_THAT((*mailed)->SetSlotMailbox((*mailbox)->all_rows(), (*mailbox)->layers()), IsOk());

  // A prompt, then single-token steps (the captured kind): every forward's logits.
  const std::vector<int32_t> tokens = DecodeBenchPrompt(12, config.vocab_size, 4);
  auto run = [&](model::Model& m) -> std::vector<std::vector<float>> {
    m.ResetCache();
    std::vector<std::vector<float>> out;
    absl::StatusOr<std::vector<float>> prompt = m.Forward(std::span<const int32_t>(tokens).first(6));
    EXPECT_THAT(prompt, IsOk());
    out.push_back(prompt.ok() ? *prompt : std::vector<float>{});
    for (size_t i = 6; i < tokens.size(); ++i) {
      absl::StatusOr<std::vector<float>> step = m.Forward(std::span<const int32_t>(tokens).subspan(i, 1));
      EXPECT_THAT(step, IsOk());
      out.push_back(step.ok() ? *step : std::vector<float>{});
    }
    return out;
  };
  auto expect_equal = [](const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want,
                         const std::string& what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t f = 0; f < got.size(); ++f) {
      ASSERT_EQ(got[f].size(), want[f].size()) << what << " forward " << f;
      float scale = 0, worst = 0;
      for (size_t i = 0; i < got[f].size(); ++i) {
        scale = std::max(scale, std::abs(want[f][i]));
        worst = std::max(worst, std::abs(got[f][i] - want[f][i]));
      }
      EXPECT_LE(worst, 1e-5f * scale) << what << " forward " << f;
    }
  };
  const std::vector<std::vector<float>> want_two = run(**two), want_four = run(**four);
  expect_equal(run(**mailed), want_two, "nothing posted");
  const int64_t captured = (*mailed)->step_graph_stats().captured;
  for (size_t li = 0; li < layers.size(); ++li) {
    for (uint32_t e = 0; e < experts; ++e) ASSERT_THAT((*mailbox)->mailbox().Post(li, e, static_cast<int32_t>(e)), IsOk());
  }
  expect_equal(run(**mailed), want_four, "every expert posted");
  EXPECT_EQ((*mailed)->step_graph_stats().captured, captured) << "a posted row must not need a new capture";
  EXPECT_EQ(kernels::MailboxEntrySlot((*mailbox)->mailbox().Published(0, 3)), 3) << "applied and published";
}

// Greedy MTP drafts chained on the stepped backend (Model::DraftOnDevice: on a GPU one captured
// graph per rows, drafts and bucket, replayed) equal the host's chain on a second copy of the
// model on the same backend (each draft's logits to the host, its argmax, the last state fed
// back), round after round as the MTP cache rolls back and grows, through warm-up, capture and
// replays. NQ_STEPPED_BACKEND=cuda on a GPU machine.
TEST_F(BenchDecodeCommandTest, DraftsChainedOnTheSteppedBackendAreItsHostDrafts) {
  const std::string release = Release();
  const char* stepped_name = std::getenv("NQ_STEPPED_BACKEND");
  const std::string name = stepped_name != nullptr ? stepped_name : "cpu";
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend(name);
  ASSERT_THAT(backend, IsOk());
  auto load = [&] {
    return release::LoadModelWithRelease(NanoModelDir(), release, release::ExpertBits::kFixedSet, **backend, nullptr,
                                         {.max_tokens = 64, .tp = {}});
  };
  absl::StatusOr<std::unique_ptr<model::Model>> host = load();
  absl::StatusOr<std::unique_ptr<model::Model>> chained = load();
  ASSERT_THAT(host, IsOk());
  ASSERT_THAT(chained, IsOk());
  ASSERT_TRUE((*host)->has_mtp());
  const int64_t D = (*host)->config().hidden_size;
  const std::vector<int32_t> prompt = DecodeBenchPrompt(24, (*host)->config().vocab_size, 11);
  ASSERT_THAT((*host)->Forward(prompt), IsOk());
  ASSERT_THAT((*chained)->Forward(prompt), IsOk());
  const std::vector<float> hidden = (*host)->last_hidden();
  const kernels::SampleParams greedy{};
  struct Round {
    size_t first, rows;
    int drafts;
  };
  // Six rounds of one shape (warm-up, capture, replays), then other shapes.
  std::vector<Round> rounds;
  for (size_t first = 0; first < 12; first += 2) rounds.push_back({first, 2, 3});
  for (const Round r : {Round{12, 1, 1}, Round{13, 4, 4}, Round{17, 3, 2}, Round{17, 3, 2}, Round{17, 3, 2}}) {
    rounds.push_back(r);
  }
  for (const Round& r : rounds) {
    const std::string what = absl::StrCat("entries from ", r.first, ", ", r.rows, " rows, ", r.drafts, " drafts");
    ASSERT_THAT((*host)->TruncateMtpCache(static_cast<int64_t>(r.first)), IsOk()) << what;
    ASSERT_THAT((*chained)->TruncateMtpCache(static_cast<int64_t>(r.first)), IsOk()) << what;
    const std::span<const int32_t> next(prompt.data() + r.first + 1, r.rows);
    const std::span<const float> states = std::span<const float>(hidden).subspan(r.first * D, r.rows * D);
    std::vector<int32_t> want;
    absl::StatusOr<std::vector<float>> logits = (*host)->ForwardMtpLast(next, states);
    ASSERT_THAT(logits, IsOk()) << what;
    want.push_back(Argmax(*logits));
    while (static_cast<int>(want.size()) < r.drafts) {
      const std::vector<float> state = (*host)->last_mtp_hidden();
      logits = (*host)->ForwardMtpLast(std::span<const int32_t>(&want.back(), 1),
                                       std::span<const float>(state).last(static_cast<size_t>(D)));
      ASSERT_THAT(logits, IsOk()) << what;
      want.push_back(Argmax(*logits));
    }
    absl::StatusOr<std::vector<int32_t>> got = (*chained)->DraftOnDevice(next, states, r.drafts, greedy);
    ASSERT_THAT(got, IsOk()) << what;
    EXPECT_EQ(*got, want) << what;
    EXPECT_EQ((*chained)->mtp_cache_length(), (*host)->mtp_cache_length()) << what;
    const std::vector<float>& last = (*chained)->last_mtp_hidden();
    const std::span<const float> want_last = std::span<const float>((*host)->last_mtp_hidden()).last(static_cast<size_t>(D));
    ASSERT_EQ(last.size(), static_cast<size_t>(D)) << what;
    float scale = 0, worst = 0;
    for (size_t i = 0; i < last.size(); ++i) {
      scale = std::max(scale, std::abs(want_last[i]));
      worst = std::max(worst, std::abs(last[i] - want_last[i]));
    }
    // The head runs on the last row alone here and on every row there: the device's GEMV may
    // round the two apart.
    EXPECT_LE(worst, (name == "cpu" ? 1e-6f : 1e-3f) * scale) << what;
  }
  if ((*backend)->CanCapture()) {
    EXPECT_GT((*chained)->step_graph_stats().captured, 0);
    EXPECT_GE((*chained)->step_graph_stats().replayed, 6) << "the repeated shapes replay their graphs";
  }
}

// Prompt 32, warm-up 2, 12 timed steps: the flags the command tests pass.
constexpr char kSmallRun[] = "--prompt-tokens 32 --warmup 2 --decode-tokens 12 --seed 5 --max-model-len 64";

TEST_F(BenchDecodeCommandTest, WritesTheReportOfTheCheckpoint) {
  const std::string out = (*root_ / "checkpoint.json").string();
  const CommandResult run = RunNq(absl::StrCat("--model ", NanoModelDir(), " ", kSmallRun, " --out ", out));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("tokens/s over 12 decode steps"));
  const nlohmann::json json = ReadJson(out);
  ASSERT_TRUE(json.is_object()) << out;
  EXPECT_EQ(json["backend"], "cpu");
  EXPECT_FALSE(json.contains("gpu"));
  EXPECT_EQ(json["release"], "");
  EXPECT_EQ(json["prompt_tokens"], 32);
  EXPECT_EQ(json["decode_tokens"], 12);
  EXPECT_EQ(json["max_model_len"], 64);
  EXPECT_GT(json["tokens_per_second"].get<double>(), 0);
  EXPECT_GT(json["decode_seconds"].get<double>(), 0);
  EXPECT_GE(json["ms_per_token_p90"].get<double>(), json["ms_per_token_p50"].get<double>());
  ASSERT_EQ(json["tokens"].size(), 12u);

  absl::StatusOr<LoadedModel> loaded = testing::LoadModel(NanoModelDir(), 64);
  ASSERT_THAT(loaded, IsOk());
  const std::vector<int32_t> prompt = DecodeBenchPrompt(32, loaded->model->config().vocab_size, 5);
  EXPECT_EQ(json["tokens"].get<std::vector<int32_t>>(), ReferenceTokens(*loaded->model, prompt, 2, 12));
}

// A penalised request (--sampling_frequency_penalty; negative, so that the tokens it has emitted
// come back): its tokens change, the report says what ran, and --device_logit_adjust (on by
// default: the draw in the step graph where one runs; on this backend the host's path either way)
// gives the same tokens as with it off.
TEST_F(BenchDecodeCommandTest, APenalisedRequestDecodesItsOwnTokens) {
  std::vector<int32_t> tokens[3];
  const char* flags[3] = {"", "--sampling_frequency_penalty=-2",
                          "--sampling_frequency_penalty=-2 --device_logit_adjust=false"};
  for (int i = 0; i < 3; ++i) {
    const std::string out = (*root_ / absl::StrCat("penalty", i, ".json")).string();
    const CommandResult run = RunNq(absl::StrCat("--model ", NanoModelDir(), " ", kSmallRun, " ", flags[i], " --out ", out));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const nlohmann::json json = ReadJson(out);
    EXPECT_EQ(json["frequency_penalty"].get<double>(), i == 0 ? 0.0 : -2.0);
    EXPECT_EQ(json["device_logit_adjust"].get<bool>(), i != 2);
    tokens[i] = json["tokens"].get<std::vector<int32_t>>();
  }
  EXPECT_NE(tokens[1], tokens[0]) << "the penalty changed nothing";
  EXPECT_EQ(tokens[2], tokens[1]);

  // A penalty outside the API's range is refused, not clamped.
  const CommandResult refused =
      RunNq(absl::StrCat("--model ", NanoModelDir(), " ", kSmallRun, " --sampling_frequency_penalty=3"));
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.output, HasSubstr("frequency_penalty"));
}

TEST_F(BenchDecodeCommandTest, WritesTheReportOfARelease) {
  const std::string release = Release();
  const std::string out = (*root_ / "release.json").string();
  const CommandResult run = RunNq(
      absl::StrCat("--model ", NanoModelDir(), " --release ", release, " --expert-bits fixed ", kSmallRun, " --out ", out));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const nlohmann::json json = ReadJson(out);
  ASSERT_TRUE(json.is_object()) << out;
  EXPECT_EQ(json["release"], release);
  EXPECT_EQ(json["expert_bits"], "fixed");
  ASSERT_EQ(json["tokens"].size(), 12u);
  EXPECT_GT(json["tokens_per_second"].get<double>(), 0);

  // The release's experts, not the checkpoint's, decoded them.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> model = release::LoadModelWithRelease(
      NanoModelDir(), release, release::ExpertBits::kFixedSet, **backend, nullptr, {.max_tokens = 64, .tp = {}});
  ASSERT_THAT(model, IsOk());
  const std::vector<int32_t> prompt = DecodeBenchPrompt(32, (*model)->config().vocab_size, 5);
  EXPECT_EQ(json["tokens"].get<std::vector<int32_t>>(), ReferenceTokens(**model, prompt, 2, 12));
}

// The device scripts' slices (scripts/device/make_slice.sh): a checkpoint without routed expert
// weights, a synthetic release for it, and bench-decode over the two, through the commands.
TEST_F(BenchDecodeCommandTest, DecodesASliceOfSyntheticWeightsAndRelease) {
  const std::string slice = (*root_ / "slice").string();
  const std::string config = std::string(NQ_SOURCE_DIR) + "/configs/test/glm5_encode.json";
  CommandResult run = RunNqCommand(
      "synth-model", absl::StrCat("--config ", config, " --out ", slice, " --dtype bf16 --seed 2 --routed_experts=false"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  run = RunNqCommand("synth-release", absl::StrCat("--model ", slice, " --out ", slice, "/release --fixed-per-layer 2 --seed 3"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("nq synth-release: wrote"));
  const std::string out = (*root_ / "slice.json").string();
  run = RunNq(absl::StrCat("--model ", slice, " --release ", slice, "/release --expert-bits 2 --prompt-tokens 8 ",
                           "--warmup 1 --decode-tokens 4 --max-model-len 32 --out ", out));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("tokens/s over 4 decode steps"));
  EXPECT_EQ(ReadJson(out)["tokens"].size(), 4u);

  // Without the release, the checkpoint has no experts to serve: refused by the tensor's name.
  run = RunNq(absl::StrCat("--model ", slice, " --prompt-tokens 8 --warmup 1 --decode-tokens 4 --max-model-len 32"));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr("mlp.experts.0"));
  // A synthetic release encodes nothing, so calibration has nothing to feed.
  run = RunNqCommand("synth-release", absl::StrCat("--model ", slice, " --out ", slice, "/r2 --calib ", config));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--calib: a synthetic release encodes no checkpoint"));
  run = RunNqCommand("synth-release", absl::StrCat("--out ", slice, "/r3"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--model and --out are required"));
  run = RunNqCommand("synth-release", absl::StrCat("--model ", (*root_ / "absent").string(), " --out ", slice, "/r4"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_THAT(run.output, HasSubstr("config.json"));
}

// --spec_drafts: the speculative step's parts timed after the decode steps, at their context,
// written beside the decode report; the decode report itself unchanged by it.
TEST_F(BenchDecodeCommandTest, TimesASpeculativeStepAfterTheDecodeSteps) {
  const std::string out = (*root_ / "spec.json").string();
  const CommandResult run =
      RunNq(absl::StrCat("--model ", NanoModelDir(), " ", kSmallRun, " --spec_drafts 3 --spec_rounds 2 --out ", out));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("spec step, 3 drafts at context 46 (2 rounds, medians): plain "));
  const nlohmann::json json = ReadJson(out);
  ASSERT_TRUE(json.contains("spec_step")) << out;
  const nlohmann::json& spec = json["spec_step"];
  EXPECT_EQ(spec["drafts"], 3);
  EXPECT_EQ(spec["context"], 46);  // the 32-token prompt, its first token, 2 warm-up and 12 timed steps, less the last
  for (const char* key :
       {"plain_ms", "verify_ms", "chained_drafts_ms", "chained_from_verified_ms", "observed_drafts_ms", "host_drafts_ms"}) {
    EXPECT_GT(spec[key].get<double>(), 0) << key;
  }
  absl::StatusOr<LoadedModel> loaded = testing::LoadModel(NanoModelDir(), 64);
  ASSERT_THAT(loaded, IsOk());
  const std::vector<int32_t> prompt = DecodeBenchPrompt(32, loaded->model->config().vocab_size, 5);
  EXPECT_EQ(json["tokens"].get<std::vector<int32_t>>(), ReferenceTokens(*loaded->model, prompt, 2, 12));

  CommandResult refused = RunNq(absl::StrCat("--model ", NanoModelDir(), " ", kSmallRun, " --spec_drafts 5"));
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.output, HasSubstr("spec step: 5 drafts (1 to 4)"));
}

TEST_F(BenchDecodeCommandTest, RefusesWhatItCannotRun) {
  CommandResult run = RunNq(absl::StrCat("--model ", NanoModelDir(), " --prompt-tokens 4050"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("4050 prompt tokens + 1 from the prefill + 4 warm-up + 64 decode tokens = 4119 "
                                    "tokens exceed the context window of 4096"));
  run = RunNq("--model " + (*root_ / "absent").string());
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_THAT(run.output, HasSubstr("absent: no such directory"));
  run = RunNq(absl::StrCat("--model ", NanoModelDir(), " --backend tpu"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("unknown backend 'tpu'"));
  run = RunNq(absl::StrCat("--model ", NanoModelDir(), " --gpu 1"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--gpu=1 applies to --backend cuda"));
  run = RunNq(absl::StrCat("--model ", NanoModelDir(), " --weight-dtype fp4"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--weight_dtype"));
  EXPECT_THAT(run.output, HasSubstr("not one of f32, bf16, fp8"));
  // Refused by name before the release is opened.
  run = RunNq(absl::StrCat("--model ", NanoModelDir(), " --release ", (*root_ / "release").string(),
                           " --expert-bits dynamic"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("dynamic needs the streamer"));
  if (!kernels::IsBackendCompiledIn("cuda")) {
    run = RunNq(absl::StrCat("--model ", NanoModelDir(), " --backend cuda"));
    EXPECT_EQ(run.exit_code, 1);
    EXPECT_THAT(run.output, HasSubstr("not compiled into this build"));
  }
}

// ---- the `nq bench-prefill` command ----

// Through the command: a short prompt in token order at the loaded 2 bits, a span past
// --full_span_tokens layer-major with every call at 4 bits read from the release.
TEST_F(BenchDecodeCommandTest, BenchPrefillReportsEachPromptsTimeAndPrecision) {
  const std::string release = Release();
  const std::string out = (*root_ / "prefill.json").string();
  const CommandResult run = RunNqCommand(
      "bench-prefill", absl::StrCat("--model ", NanoModelDir(), " --release ", release,
                                    " --expert-bits 2 --prefill-lengths 64,300 --prefill-rounds 1 "
                                    "--layer-major-prefill-tokens 256 --prefill-full-span-tokens 256 --prefill-chunk-tokens 128 "
                                    "--out ",
                                    out));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const nlohmann::json json = ReadJson(out);
  ASSERT_TRUE(json.is_object()) << out;
  EXPECT_EQ(json["chunk_tokens"], 128);
  const nlohmann::json& rows = json["rows"];
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0]["prompt_tokens"], 64);
  EXPECT_EQ(rows[0]["prefill"], "token-order");
  EXPECT_EQ(rows[0]["share_4bit"], 0.0);
  EXPECT_EQ(rows[1]["prompt_tokens"], 300);
  EXPECT_EQ(rows[1]["prefill"], "layer-major");
  EXPECT_EQ(rows[1]["share_4bit"], 1.0);
  EXPECT_GT(rows[1]["records_prefetched_used"].get<int64_t>() + rows[1]["records_read_late"].get<int64_t>(), 0);
  for (const nlohmann::json& row : rows) EXPECT_GT(row["seconds"].get<double>(), 0);
}

TEST_F(BenchDecodeCommandTest, BenchPrefillRefusesWhatItCannotRun) {
  CommandResult run = RunNqCommand("bench-prefill", absl::StrCat("--model ", NanoModelDir(), " --prefill-lengths 5000"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("exceed the model's 4096 positions"));
  run = RunNqCommand("bench-prefill", absl::StrCat("--model ", NanoModelDir(), " --prefill-lengths 64,x"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("'x' is not a positive token count"));
  run = RunNqCommand("bench-prefill", absl::StrCat("--model ", NanoModelDir(), " --release ", Release(), " --prefill-lengths 64"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--expert_bits=fixed: bench-prefill takes 2"));
  run = RunNqCommand("bench-prefill", "--prefill-lengths 64");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--model DIR is required"));
}

}  // namespace
}  // namespace nq::worker
