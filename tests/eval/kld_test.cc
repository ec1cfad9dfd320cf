// nq kld (issue #7): the float64 KL against hand-computed values, KL = 0 for a model against
// itself, every local mode on a fixture model with the orderings that must hold, offline MTP
// acceptance, and bad input. The model the mode smoke runs on is a test parameter: the HF
// fixture glm5_tiny always, models/glm5_nano when it is in the tree, and NQ_KLD_MODEL_DIR.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/eval/kl_divergence.h"
#include "services/eval/kld_harness.h"
#include "services/eval/kld_run.h"
#include "services/eval/kld_student.h"
#include "services/eval/mtp_acceptance.h"
#include "services/model/model.h"
#include "services/release/release_encoder.h"
#include "services/release/release_experts.h"
#include "tests/common/status_matchers.h"

namespace nq::eval {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using release::EncodeRelease;
using release::ExpertBits;
using release::LoadModelWithRelease;
namespace fs = std::filesystem;

// Logits whose softmax is `probabilities` (plus an arbitrary shift, which softmax ignores).
std::vector<float> LogitsOf(const std::vector<double>& probabilities, double shift) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(static_cast<float>(std::log(p) + shift));
  return logits;
}

TEST(KlDivergenceTest, IdenticalLogitsHaveZeroKl) {
  const std::vector<float> logits = {0.5f, -3.0f, 2.25f, 7.0f, -0.125f};
  absl::StatusOr<TokenKl> kl = KlDivergence(logits, logits);
  ASSERT_THAT(kl, IsOk());
  EXPECT_EQ(kl->kl, 0.0);
  EXPECT_TRUE(kl->top1_agrees);
}

TEST(KlDivergenceTest, MatchesHandComputedPairs) {
  // softmax(0, ln 3) = (1/4, 3/4) against softmax(0, 0) = (1/2, 1/2).
  absl::StatusOr<TokenKl> two =
      KlDivergence(std::vector<float>{0.0f, static_cast<float>(std::log(3.0))}, std::vector<float>{0.0f, 0.0f});
  ASSERT_THAT(two, IsOk());
  EXPECT_NEAR(two->kl, 0.25 * std::log(0.5) + 0.75 * std::log(1.5), 1e-7);
  EXPECT_FALSE(two->top1_agrees) << "argmax (1/4, 3/4) is 1; argmax (1/2, 1/2) is the first index, 0";

  const std::vector<double> p = {0.7, 0.2, 0.1}, q = {0.2, 0.5, 0.3};
  double expected = 0;
  for (size_t i = 0; i < p.size(); ++i) expected += p[i] * std::log(p[i] / q[i]);
  absl::StatusOr<TokenKl> three = KlDivergence(LogitsOf(p, 4.0), LogitsOf(q, -11.0));
  ASSERT_THAT(three, IsOk());
  EXPECT_NEAR(three->kl, expected, 1e-6) << "KL is invariant to shifting either row's logits";
  EXPECT_FALSE(three->top1_agrees);
  // KL is not symmetric.
  absl::StatusOr<TokenKl> reverse = KlDivergence(LogitsOf(q, 0.0), LogitsOf(p, 0.0));
  ASSERT_THAT(reverse, IsOk());
  EXPECT_GT(std::abs(reverse->kl - three->kl), 1e-3);
}

TEST(KlDivergenceTest, LogSoftmaxIsFloat64AndStable) {
  // Logits far apart: a float32 softmax would underflow the small ones to 0.
  const std::vector<float> logits = {1000.0f, 0.0f};
  std::vector<double> out(2);
  ASSERT_THAT(LogSoftmax(logits, out), IsOk());
  EXPECT_NEAR(out[0], 0.0, 1e-12);
  EXPECT_NEAR(out[1], -1000.0, 1e-9);
}

TEST(KlDivergenceTest, RowsAndSummaries) {
  const std::vector<float> p = {0.0f, 1.0f, 2.0f, 0.0f, 0.0f, 0.0f};
  absl::StatusOr<std::vector<TokenKl>> rows = KlDivergenceRows(p, p, 3);
  ASSERT_THAT(rows, IsOk());
  EXPECT_EQ(rows->size(), 2u);

  std::vector<TokenKl> tokens;
  for (int i = 0; i < 100; ++i) tokens.push_back({.kl = static_cast<double>(i), .top1_agrees = i % 4 != 0});
  const KlSummary s = SummarizeKl(tokens);
  EXPECT_EQ(s.tokens, 100);
  EXPECT_DOUBLE_EQ(s.mean, 49.5);
  EXPECT_DOUBLE_EQ(s.median, 49.5);
  EXPECT_NEAR(s.p99, 98.01, 1e-9);  // 0.99 * 99 between order statistics 98 and 99
  EXPECT_DOUBLE_EQ(s.top1_agreement, 0.75);
  EXPECT_EQ(SummarizeKl({}).tokens, 0);
}

TEST(KlDivergenceTest, BadLogitsAreRefused) {
  std::vector<double> out(1);
  EXPECT_THAT(LogSoftmax({}, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no logits")));
  EXPECT_THAT(LogSoftmax(std::vector<float>{1.0f, 2.0f}, out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 logits but room for 1")));
  EXPECT_THAT(KlDivergence(std::vector<float>{1.0f, NAN}, std::vector<float>{1.0f, 2.0f}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit 1 is nan")));
  EXPECT_THAT(KlDivergence(std::vector<float>{1.0f}, std::vector<float>{1.0f, 2.0f}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("over 1 and 2 tokens")));
  EXPECT_THAT(KlDivergenceRows(std::vector<float>(5), std::vector<float>(5), 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[rows, 2]")));
}

// Models the mode smoke runs on.
std::vector<std::string> KldModelDirs() {
  std::vector<std::string> dirs = {std::string(NQ_SOURCE_DIR) + "/tests/fixtures/models/glm5_tiny"};
  const std::string nano = std::string(NQ_SOURCE_DIR) + "/models/glm5_nano";
  if (fs::exists(fs::path(nano) / "config.json")) dirs.push_back(nano);
  if (const char* extra = std::getenv("NQ_KLD_MODEL_DIR"); extra != nullptr && *extra != '\0') dirs.push_back(extra);
  return dirs;
}

// Deterministic token ids below `vocab` (a linear congruential sequence).
std::vector<int32_t> SomeTokens(size_t n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids;
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    ids.push_back(static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab)));
  }
  return ids;
}

constexpr int64_t kWindow = 32;  // two blocks of 16: the previous-block policy gets a previous block
constexpr int kSlots = 4;
constexpr int kFixedPerLayer = 2;

// One release of the model per test suite: encoding is the slow part.
class KldModeTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { releases_ = new std::map<std::string, std::string>(); }
  static void TearDownTestSuite() {
    for (const auto& [model, release] : *releases_) {
      if (!release.empty()) fs::remove_all(fs::path(release).parent_path());
    }
    delete releases_;
  }

  void SetUp() override {
    model_dir_ = GetParam();
    absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(model_dir_);
    ASSERT_THAT(config, IsOk());
    config_ = *config;
    std::string& release = (*releases_)[model_dir_];
    if (release.empty()) {
      const fs::path root = fs::temp_directory_path() /
                            absl::StrCat("nq-kld-test-", getpid(), "-", fs::path(model_dir_).filename().string());
      fs::remove_all(root);
      const std::string dir = (root / "release").string();
      ASSERT_THAT(EncodeRelease(model_dir_, dir, {.fixed_per_layer = kFixedPerLayer}), IsOk());
      release = dir;
    }
    release_dir_ = release;
    // Domain a: sequences of 48 (windows of 32 + 16) and 32 tokens; b: 40 tokens (32 + 8).
    domains_ = {
        {.name = "a", .sequences = {SomeTokens(48, config_.vocab_size, 1), SomeTokens(32, config_.vocab_size, 2)}},
        {.name = "b", .sequences = {SomeTokens(40, config_.vocab_size, 3)}}};
  }

  absl::StatusOr<KldRunReport> Run(KldMode mode) {
    return EvaluateKld({.teacher_dir = model_dir_,
                        .release_dir = release_dir_,
                        .mode = mode,
                        .window = kWindow,
                        .slots = kSlots,
                        .domains = domains_});
  }

  static std::map<std::string, std::string>* releases_;
  std::string model_dir_, release_dir_;
  model::ModelConfig config_;
  std::vector<KldDomain> domains_;
};
std::map<std::string, std::string>* KldModeTest::releases_ = nullptr;

TEST_P(KldModeTest, ModelAgainstItselfHasZeroKl) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> a =
      model::Model::Load(model_dir_, **backend, nullptr, {.max_tokens = kWindow});
  absl::StatusOr<std::unique_ptr<model::Model>> b =
      model::Model::Load(model_dir_, **backend, nullptr, {.max_tokens = kWindow});
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ModelLogitSource teacher(**a), student(**b);
  absl::StatusOr<KldReport> report = MeasureKld(teacher, student, domains_, kWindow);
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->overall.tokens, 48 + 32 + 40);
  EXPECT_EQ(report->overall.mean, 0.0);
  EXPECT_EQ(report->overall.p99, 0.0);
  EXPECT_EQ(report->overall.top1_agreement, 1.0);
  ASSERT_EQ(report->domains.size(), 2u);
  EXPECT_EQ(report->domains[1].name, "b");
  EXPECT_EQ(report->domains[1].kl.tokens, 40);
}

TEST_P(KldModeTest, EveryLocalModeRunsAndOrdersAsItMust) {
  std::map<KldMode, KldRunReport> reports;
  for (KldMode mode :
       {KldMode::kAll4Bit, KldMode::kAll2Bit, KldMode::kFixedSet, KldMode::kOracle, KldMode::kPreviousBlock}) {
    absl::StatusOr<KldRunReport> report = Run(mode);
    ASSERT_THAT(report, IsOk()) << KldModeName(mode);
    std::printf(
        "[ kld      ] %s %-14s mean KL %.6f median %.6f p99 %.6f top-1 %.4f; 4-bit calls %.4f weight %.4f "
        "held %.4f; %.3f bits/weight\n",
        fs::path(model_dir_).filename().c_str(), KldModeName(mode), report->kl.overall.mean, report->kl.overall.median,
        report->kl.overall.p99, report->kl.overall.top1_agreement, report->usage.CallShare(),
        report->usage.WeightShare(), report->usage.HeldShare(), report->bytes.BitsPerWeight(report->usage.HeldShare()));
    EXPECT_EQ(report->kl.overall.tokens, 120) << KldModeName(mode);
    EXPECT_GT(report->kl.overall.mean, 0) << KldModeName(mode);
    EXPECT_GT(report->usage.calls, 0) << KldModeName(mode);
    reports.emplace(mode, *std::move(report));
  }
  const KldRunReport &four = reports.at(KldMode::kAll4Bit), &two = reports.at(KldMode::kAll2Bit);
  const KldRunReport &fixed = reports.at(KldMode::kFixedSet), &oracle = reports.at(KldMode::kOracle);
  const KldRunReport& previous = reports.at(KldMode::kPreviousBlock);
  EXPECT_LT(four.kl.overall.mean, two.kl.overall.mean);
  EXPECT_GE(four.kl.overall.top1_agreement, two.kl.overall.top1_agreement);

  // Each of the 120 tokens makes top_k calls in every MoE layer of the stack.
  int64_t stack_moe_layers = 0;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) stack_moe_layers += config_.IsMoeLayer(l) ? 1 : 0;
  EXPECT_EQ(two.usage.calls, 120.0 * static_cast<double>(config_.num_experts_per_tok * stack_moe_layers));
  EXPECT_EQ(four.usage.CallShare(), 1.0);
  EXPECT_EQ(four.usage.WeightShare(), 1.0);
  EXPECT_EQ(four.usage.HeldShare(), 1.0);
  EXPECT_EQ(two.usage.CallShare(), 0.0);
  EXPECT_EQ(two.usage.WeightShare(), 0.0);
  EXPECT_EQ(two.usage.HeldShare(), 0.0);
  const double fixed_share = static_cast<double>(kFixedPerLayer) / static_cast<double>(config_.n_routed_experts);
  EXPECT_DOUBLE_EQ(fixed.usage.HeldShare(), fixed_share);
  // The floating slots add at most F experts per layer and block to the fixed set.
  const double most_held = static_cast<double>(kFixedPerLayer + kSlots) / static_cast<double>(config_.n_routed_experts);
  for (const KldRunReport* r : {&oracle, &previous}) {
    EXPECT_GE(r->usage.HeldShare(), fixed_share);
    EXPECT_LE(r->usage.HeldShare(), most_held);
  }
  EXPECT_DOUBLE_EQ(oracle.usage.HeldShare(), most_held) << "the oracle fills its F slots in every block";
  EXPECT_GE(oracle.usage.CallShare(), previous.usage.CallShare());
  EXPECT_GE(previous.usage.CallShare(), fixed.usage.CallShare());
  EXPECT_GT(oracle.usage.CallShare(), fixed.usage.CallShare());

  // Bits per weight: the 2-bit base plus the residual of the experts held at 4 bits.
  EXPECT_EQ(fixed.bytes.weights, static_cast<uint64_t>(stack_moe_layers * config_.n_routed_experts * 3 *
                                                       config_.moe_intermediate_size * config_.hidden_size));
  EXPECT_LT(two.bytes.BitsPerWeight(0), fixed.bytes.BitsPerWeight(fixed.usage.HeldShare()));
  EXPECT_LT(fixed.bytes.BitsPerWeight(fixed.usage.HeldShare()), four.bytes.BitsPerWeight(1));
  // The residual planes are 2 bits a weight (nested_scalar_v1's residual_bits).
  EXPECT_DOUBLE_EQ(four.bytes.BitsPerWeight(1) - four.bytes.BitsPerWeight(0), 2.0);

  const nlohmann::ordered_json json = KldReportJson(oracle);
  EXPECT_EQ(json["mode"], "oracle");
  EXPECT_EQ(json["tokens"], 120);
  EXPECT_EQ(json["domains"]["b"]["tokens"], 40);
  EXPECT_DOUBLE_EQ(json["four_bit_share"]["calls"].get<double>(), oracle.usage.CallShare());
  EXPECT_THAT(KldReportTable(oracle), HasSubstr("| b | 40 |"));
}

// The fixed-set mode through the hook equals the model loaded with the fixed set replacing
// its experts (LoadModelWithRelease), and its 4-bit share is the fixed experts' calls in
// that model's own routing.
TEST_P(KldModeTest, FixedSetModeMatchesTheFixedSetModel) {
  absl::StatusOr<KldRunReport> report = Run(KldMode::kFixedSet);
  ASSERT_THAT(report, IsOk());
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> teacher_model =
      model::Model::Load(model_dir_, **backend, nullptr, {.max_tokens = kWindow});
  absl::StatusOr<std::unique_ptr<model::Model>> fixed_model = LoadModelWithRelease(
      model_dir_, release_dir_, ExpertBits::kFixedSet, **backend, nullptr, {.max_tokens = kWindow});
  ASSERT_THAT(teacher_model, IsOk());
  ASSERT_THAT(fixed_model, IsOk());
  absl::StatusOr<format::Release> release = format::Release::Open(release_dir_);
  ASSERT_THAT(release, IsOk());
  double calls = 0, fixed_calls = 0;
  (*fixed_model)->SetRoutingObserver([&](int64_t layer, const model::MoeRouting& routing) {
    const std::vector<uint32_t>& fixed = release->manifest().FindLayer(static_cast<uint32_t>(layer))->fixed_4bit;
    for (int32_t e : routing.experts) {
      calls += 1;
      fixed_calls += std::find(fixed.begin(), fixed.end(), static_cast<uint32_t>(e)) != fixed.end() ? 1 : 0;
    }
  });
  ModelLogitSource teacher(**teacher_model), student(**fixed_model);
  absl::StatusOr<KldReport> direct = MeasureKld(teacher, student, domains_, kWindow);
  ASSERT_THAT(direct, IsOk());
  EXPECT_EQ(report->usage.calls, calls);
  EXPECT_DOUBLE_EQ(report->usage.CallShare(), fixed_calls / calls);
  EXPECT_NEAR(report->kl.overall.mean, direct->overall.mean, 1e-9 * direct->overall.mean);
  EXPECT_EQ(report->kl.overall.top1_agreement, direct->overall.top1_agreement);
}

// MeasureMtpAcceptance's counts recomputed another way: the main model one token at a time
// through its cache (the greedy choice at each position of a window) and the MTP layer one entry
// at a time (entry i reads position i's hidden state and token i+1, and drafts token i+2); a draft
// counts as accepted iff it equals the main model's greedy token at position i+1.
MtpAcceptance ExpectedAcceptance(model::Model& model, const KldDomain& domain, int64_t window) {
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  const size_t hidden = static_cast<size_t>(model.config().hidden_size);
  auto argmax = [&](const std::vector<float>& row) {
    return static_cast<int32_t>(std::max_element(row.begin(), row.begin() + vocab) - row.begin());
  };
  MtpAcceptance expected;
  for (const std::vector<int32_t>& sequence : domain.sequences) {
    for (size_t start = 0; start < sequence.size(); start += static_cast<size_t>(window)) {
      const size_t T = std::min<size_t>(static_cast<size_t>(window), sequence.size() - start);
      if (T < 2) continue;
      const std::span<const int32_t> w = std::span<const int32_t>(sequence).subspan(start, T);
      model.ResetCache();
      std::vector<int32_t> greedy;
      std::vector<std::vector<float>> states;
      for (size_t i = 0; i < T; ++i) {
        absl::StatusOr<std::vector<float>> logits = model.Forward(w.subspan(i, 1));
        if (!logits.ok()) {
          ADD_FAILURE() << logits.status();
          return {};
        }
        greedy.push_back(argmax(*logits));
        states.emplace_back(model.last_hidden().begin(), model.last_hidden().begin() + hidden);
      }
      for (size_t i = 0; i + 1 < T; ++i) {
        absl::StatusOr<std::vector<float>> draft = model.ForwardMtp(w.subspan(i + 1, 1), states[i]);
        if (!draft.ok()) {
          ADD_FAILURE() << draft.status();
          return {};
        }
        const int32_t drafted = argmax(*draft);
        ++expected.drafts;
        expected.accepted += drafted == greedy[i + 1] ? 1 : 0;
        if (i + 2 < T) {
          ++expected.text_drafts;
          expected.text_matches += drafted == w[i + 2] ? 1 : 0;
        }
      }
    }
  }
  return expected;
}

void ExpectSameCounts(const MtpAcceptance& got, const MtpAcceptance& want, const std::string& what) {
  EXPECT_EQ(got.drafts, want.drafts) << what;
  EXPECT_EQ(got.accepted, want.accepted) << what;
  EXPECT_EQ(got.text_drafts, want.text_drafts) << what;
  EXPECT_EQ(got.text_matches, want.text_matches) << what;
}

TEST_P(KldModeTest, MtpDraftAcceptance) {
  if (config_.num_nextn_predict_layers < 1) GTEST_SKIP() << "no MTP layer";
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> model =
      model::Model::Load(model_dir_, **backend, nullptr, {.max_tokens = kWindow});
  ASSERT_THAT(model, IsOk());
  absl::StatusOr<MtpAcceptanceReport> report = MeasureMtpAcceptance(**model, domains_, kWindow);
  ASSERT_THAT(report, IsOk());
  // Windows of 32, 16, 32 and 32, 8 tokens: a window of T tokens drafts T - 1 times.
  EXPECT_EQ(report->overall.drafts, 31 + 15 + 31 + 31 + 7);
  EXPECT_EQ(report->overall.text_drafts, 30 + 14 + 30 + 30 + 6);
  MtpAcceptance expected;
  ASSERT_EQ(report->domains.size(), domains_.size());
  for (size_t d = 0; d < domains_.size(); ++d) {
    const MtpAcceptance part = ExpectedAcceptance(**model, domains_[d], kWindow);
    EXPECT_EQ(report->domains[d].first, domains_[d].name);
    ExpectSameCounts(report->domains[d].second, part, "domain " + domains_[d].name);
    expected.drafts += part.drafts;
    expected.accepted += part.accepted;
    expected.text_drafts += part.text_drafts;
    expected.text_matches += part.text_matches;
  }
  ExpectSameCounts(report->overall, expected, "overall");
  EXPECT_GT(expected.accepted, 0) << "no draft accepted: equal counts would say little";
  std::printf("[ mtp      ] %s: acceptance %.4f over %lld drafts (draft = text %.4f)\n",
              fs::path(model_dir_).filename().c_str(), report->overall.rate(),
              static_cast<long long>(report->overall.drafts), report->overall.text_rate());
  EXPECT_THAT(MeasureMtpAcceptance(**model, domains_, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--window 1")));
}

TEST_P(KldModeTest, BadRequestsAreRefused) {
  KldRequest request{.teacher_dir = model_dir_, .release_dir = release_dir_, .window = kWindow, .domains = domains_};
  request.window = 1;
  EXPECT_THAT(EvaluateKld(request), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--window 1")));
  request.window = kWindow;
  request.slots = -1;
  EXPECT_THAT(EvaluateKld(request), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--slots -1")));
  request.slots = kSlots;

  KldRequest out_of_vocab = request;
  out_of_vocab.domains[1].sequences[0][5] = static_cast<int32_t>(config_.vocab_size);
  EXPECT_THAT(EvaluateKld(out_of_vocab),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("domain 'b' sequence 0 position 5: token ", config_.vocab_size,
                                              " is outside the model's vocabulary"))));
  KldRequest no_tokens = request;
  no_tokens.domains.clear();
  EXPECT_THAT(EvaluateKld(no_tokens), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokens")));

  KldRequest no_teacher = request;
  no_teacher.teacher_dir = "/nonexistent/teacher";
  EXPECT_THAT(EvaluateKld(no_teacher),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/teacher/config.json")));
  KldRequest no_release = request;
  no_release.release_dir = "/nonexistent/release";
  EXPECT_THAT(EvaluateKld(no_release),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("release /nonexistent/release")));

  request.mode = KldMode::kLive;
  EXPECT_THAT(EvaluateKld(request), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--streamer")));
  EXPECT_THAT(ParseKldMode("all-3-bit"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown --mode 'all-3-bit'")));
  for (const char* name : {"all-4-bit", "all-2-bit", "fixed-set", "oracle", "previous-block", "live"}) {
    absl::StatusOr<KldMode> mode = ParseKldMode(name);
    ASSERT_THAT(mode, IsOk());
    EXPECT_STREQ(KldModeName(*mode), name);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, KldModeTest, ::testing::ValuesIn(KldModelDirs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = fs::path(info.param).filename().string();
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return absl::StrCat(name, "_", info.index);
                         });

class KldTokensTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / absl::StrCat("nq-kld-tokens-", getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (root_ / name).string();
    std::ofstream(path) << text;
    return path;
  }
  fs::path root_;
};

TEST_F(KldTokensTest, ReadsListsObjectsAndLines) {
  const std::vector<std::string> paths = {Write("python.json", "[1, 2, 3]"),
                                          Write("mixed.json", R"({"zeta": [4, 5], "alpha": [[6, 7], [8]]})"),
                                          Write("prose.txt", "9, 10\n11 12 13\n")};
  absl::StatusOr<std::vector<KldDomain>> domains = ReadKldTokens(paths);
  ASSERT_THAT(domains, IsOk());
  ASSERT_EQ(domains->size(), 4u);
  EXPECT_EQ((*domains)[0].name, "python");
  EXPECT_EQ((*domains)[0].sequences, (std::vector<std::vector<int32_t>>{{1, 2, 3}}));
  EXPECT_EQ((*domains)[1].name, "zeta") << "object keys keep the file's order";
  EXPECT_EQ((*domains)[2].name, "alpha");
  EXPECT_EQ((*domains)[2].sequences, (std::vector<std::vector<int32_t>>{{6, 7}, {8}}));
  EXPECT_EQ((*domains)[3].name, "prose");
  EXPECT_EQ((*domains)[3].sequences, (std::vector<std::vector<int32_t>>{{9, 10}, {11, 12, 13}}));

  absl::StatusOr<std::vector<KldDomain>> picked = SelectDomains(*domains, std::vector<std::string>{"prose", "zeta"});
  ASSERT_THAT(picked, IsOk());
  ASSERT_EQ(picked->size(), 2u);
  EXPECT_EQ((*picked)[0].name, "prose");
  EXPECT_THAT(SelectDomains(*domains, std::vector<std::string>{"rust"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no domain 'rust' in the token files (they hold: "
                                                                     "python, zeta, alpha, prose)")));
  EXPECT_EQ(LongestWindow(*domains, 2), 2);
  EXPECT_EQ(LongestWindow(*domains, 100), 3);
}

TEST_F(KldTokensTest, BadTokenFilesAreRefused) {
  auto read = [](const std::string& path) { return ReadKldTokens(std::vector<std::string>{path}); };
  EXPECT_THAT(read((root_ / "missing.json").string()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot read token file")));
  EXPECT_THAT(read(Write("broken.json", "[1, 2")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(read(Write("negative.json", "[1, -2]")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative.json[1]: -2 is not a token id")));
  EXPECT_THAT(read(Write("strings.json", R"({"d": ["a"]})")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"d\"[0]: \"a\" is not a token id")));
  EXPECT_THAT(read(Write("empty.json", "[]")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds no token ids")));
  EXPECT_THAT(read(Write("nothing.json", "{}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names no domains")));
  EXPECT_THAT(read(Write("bad.txt", "1, x\n")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'x' is not a token id")));
  EXPECT_THAT(ReadKldTokens(std::vector<std::string>{Write("d.json", "[1]"), Write("two.json", R"({"d": [2]})")}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("domain 'd' is given twice")));
  EXPECT_THAT(ReadKldTokens({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no token files")));
}

}  // namespace
}  // namespace nq::eval
