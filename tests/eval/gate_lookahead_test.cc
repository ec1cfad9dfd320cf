// Gate lookahead measured on the embedded model (models/glm5_nano: trained, so its routing is
// real): the recall arithmetic, that the lookahead leaves the forward's logits alone, and that a
// layer's router on the previous layer's output knows its experts far better than chance and
// than the previous token's experts.
#include "services/eval/gate_lookahead.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "nlohmann/json.hpp"
#include "services/model/model.h"
#include "tests/common/run_shell.h"
#include "tests/common/status_matchers.h"

namespace nq::eval {
namespace {

using ::nq::testing::CommandResult;
using ::nq::testing::IsOk;
using ::nq::testing::RunShell;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kModel[] = NQ_SOURCE_DIR "/models/glm5_nano";

TEST(GateLookaheadTest, RecallCountsTheActualCallsFoundInTheGuess) {
  // Two tokens, top-2: token 1 routes to experts 5 (weight 0.75) and 2 (0.25).
  const model::MoeRouting actual{.num_tokens = 2, .top_k = 2, .experts = {0, 1, 5, 2}, .weights = {0.5f, 0.5f, 0.75f, 0.25f}, .input_sq_norms = {}};
  const model::MoeRouting guess{.num_tokens = 2, .top_k = 2, .experts = {5, 7, 3, 2}, .weights = {0.5f, 0.5f, 0.5f, 0.5f}, .input_sq_norms = {}};
  LookaheadRecall recall;
  AddRecall(actual, 1, guess, 0, recall);  // guessed {5, 7}: finds expert 5
  EXPECT_EQ(recall.calls, 2);
  EXPECT_DOUBLE_EQ(recall.recall(), 0.5);
  EXPECT_DOUBLE_EQ(recall.weight_recall(), 0.75);
  AddRecall(actual, 1, guess, 1, recall);  // guessed {3, 2}: finds expert 2
  EXPECT_EQ(recall.calls, 4);
  EXPECT_DOUBLE_EQ(recall.recall(), 0.5);
  EXPECT_DOUBLE_EQ(recall.weight_recall(), 0.5);
}

std::vector<std::vector<int32_t>> HeldOutSequences(size_t count, size_t length) {
  std::ifstream in(std::string(kModel) + "/eval/stdlib_code.tokens.json");
  const std::vector<int32_t> tokens = nlohmann::json::parse(in).get<std::vector<int32_t>>();
  std::vector<std::vector<int32_t>> sequences;
  for (size_t i = 0; i < count; ++i) {
    sequences.emplace_back(tokens.begin() + static_cast<std::ptrdiff_t>(i * length),
                           tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * length));
  }
  return sequences;
}

TEST(GateLookaheadTest, TheNextLayersRouterKnowsItsExpertsBetterThanThePreviousToken) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> model = model::Model::Load(kModel, **backend, nullptr, {.max_tokens = 256});
  ASSERT_THAT(model, IsOk());
  const std::vector<std::vector<int32_t>> sequences = HeldOutSequences(2, 256);
  const model::ModelConfig& config = (*model)->config();

  // The lookahead routes a copy of the hidden state: the logits do not move.
  absl::StatusOr<std::vector<float>> plain = (*model)->Forward(sequences[0]);
  ASSERT_THAT(plain, IsOk());
  int calls = 0;
  (*model)->SetLookaheadObserver(1, [&](int64_t, const model::MoeRouting&) { ++calls; });
  (*model)->ResetCache();
  absl::StatusOr<std::vector<float>> observed = (*model)->Forward(sequences[0]);
  ASSERT_THAT(observed, IsOk());
  EXPECT_EQ(*observed, *plain);
  (*model)->SetLookaheadObserver(0, nullptr);

  absl::StatusOr<LookaheadReport> report = MeasureGateLookahead(**model, sequences, 1);
  ASSERT_THAT(report, IsOk());
  int moe_after_first = 0;
  for (int64_t l = 1; l < config.num_hidden_layers; ++l) moe_after_first += config.IsMoeLayer(l);
  EXPECT_EQ(calls, moe_after_first);
  ASSERT_EQ(static_cast<int>(report->layers.size()), moe_after_first);
  EXPECT_EQ(report->lookahead.calls, moe_after_first * 2 * 255 * config.num_experts_per_tok);
  EXPECT_EQ(report->previous_token.calls, report->lookahead.calls);
  const double chance = static_cast<double>(config.num_experts_per_tok) / static_cast<double>(config.n_routed_experts);
  EXPECT_GT(report->lookahead.recall(), 3 * chance);
  EXPECT_GT(report->lookahead.recall(), report->previous_token.recall() + 0.2);
  EXPECT_GT(report->lookahead.weight_recall(), report->lookahead.recall());  // the heavy experts are the easier

  // Deeper lookahead scores fewer layers and knows less.
  absl::StatusOr<LookaheadReport> deeper = MeasureGateLookahead(**model, sequences, 3);
  ASSERT_THAT(deeper, IsOk());
  EXPECT_LT(deeper->layers.size(), report->layers.size());
  EXPECT_LT(deeper->lookahead.recall(), report->lookahead.recall());
  // Past the last layer nothing is scored; depth 0 is refused.
  absl::StatusOr<LookaheadReport> none = MeasureGateLookahead(**model, sequences, config.num_hidden_layers);
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->lookahead.calls, 0);
  EXPECT_THAT(MeasureGateLookahead(**model, sequences, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("depth 0: want >= 1")));
  EXPECT_THAT(MeasureGateLookahead(**model, {}, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no token sequences")));
}

// `nq lookahead` and `nq replay --landing_tokens` / `--refresh_interval` refuse what they cannot measure, by name.
CommandResult RunNq(const std::string& args) { return RunShell(absl::StrCat(NQ_TOOL_BIN, " ", args)); }

void ExpectRefused(const CommandResult& run, const ::testing::Matcher<const std::string&>& message) {
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, message);
}

TEST(GateLookaheadTest, TheCommandsRefuseBadFlags) {
  const std::string tokens = ::testing::TempDir() + "/lookahead_tokens.txt";
  std::ofstream(tokens) << "1 2 3 4 5 6 7 8\n";
  const std::string model = std::string("--model ") + kModel + " --tokens " + tokens;
  ExpectRefused(RunNq("lookahead " + model + " --depths 0"), HasSubstr("\"0\" is not a depth >= 1"));
  ExpectRefused(RunNq("lookahead " + model + " --depths one"), HasSubstr("\"one\" is not a depth"));
  ExpectRefused(RunNq("lookahead --tokens " + tokens), HasSubstr("--model DIR and --tokens FILE are required"));
  ExpectRefused(RunNq("lookahead --model /nonexistent/model --tokens " + tokens), HasSubstr("/nonexistent/model"));
  ExpectRefused(RunNq("replay --trace " + tokens + " --landing_tokens=-1"), HasSubstr("--landing_tokens >= 0"));
  ExpectRefused(RunNq("replay --trace " + tokens + " --refresh_interval=0"), HasSubstr("--refresh_interval must be >= 1"));
  // A run: one row per depth.
  const CommandResult run = RunNq("lookahead " + model + " --depths 1,2");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("| 1 | 4 |"));
  EXPECT_THAT(run.output, HasSubstr("| 2 | 3 |"));
}

}  // namespace
}  // namespace nq::eval
