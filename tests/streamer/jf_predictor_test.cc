// The predictor with the learned scorer (jF) and the predictor state that survives a
// restart; the routing trace's sequences and input norms (format version 2).
#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/streamer/jf_features.h"
#include "services/streamer/predictor.h"
#include "services/streamer/replay.h"
#include "services/streamer/routing_trace.h"
#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::string kFixture = std::string(NQ_SOURCE_DIR) + "/tests/fixtures/jf";

std::shared_ptr<const JfModel> FixtureModel() {
  absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(kFixture + "/model.safetensors");
  EXPECT_THAT(model.status(), IsOk());
  return model.ok() ? *model : nullptr;
}

RoutingTrace FixtureTrace() {
  absl::StatusOr<RoutingTrace> trace = ReadTrace(kFixture + "/trace.nqrt");
  EXPECT_THAT(trace.status(), IsOk());
  return trace.ok() ? *trace : RoutingTrace{};
}

PredictorOptions LearnedOptions() {
  PredictorOptions options;
  options.num_layers = 2;
  options.experts_per_layer = 8;
  options.floating_slots = 3;
  options.top_k = 2;
  options.read_budget = 100;
  options.hysteresis_margin = 0.1f;
  options.learned = FixtureModel();
  return options;
}

TEST(JfPredictorTest, CreateRefusesAModelOfAnotherGeometry) {
  PredictorOptions options = LearnedOptions();
  options.experts_per_layer = 16;
  EXPECT_THAT(Predictor::Create(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("trained for 2 MoE layers x 8 experts")));
  options = LearnedOptions();
  options.top_k = 0;
  EXPECT_THAT(Predictor::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs top_k")));
}

TEST(JfPredictorTest, ScoresAreTheModelsExpectedHitsInShareUnits) {
  const RoutingTrace trace = FixtureTrace();
  absl::StatusOr<Predictor> predictor = Predictor::Create(LearnedOptions());
  ASSERT_THAT(predictor.status(), IsOk());
  absl::StatusOr<JfFeatureState> features = JfFeatureState::Create(2, 8, 2);
  predictor->NewSequence();
  for (size_t t = 0; t < 16; ++t) {
    ASSERT_THAT(predictor->Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t)), IsOk());
    features->Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t));
  }
  ASSERT_TRUE(predictor->RefreshDue());
  predictor->Refresh();
  // Residency was empty when the refresh scored: feature 14 is 0 everywhere.
  std::vector<float> rows(JfFeatureStride(8) * kJfFeatures), hits(8);
  features->Fill(1, std::vector<uint8_t>(8, 0), rows);
  LearnedOptions().learned->Forward(1, rows, hits);
  for (uint32_t e = 0; e < 8; ++e) {
    EXPECT_FLOAT_EQ(predictor->Score(1, e), hits[e] * 8.0f / (64.0f * 2.0f)) << e;
  }
}

TEST(JfPredictorTest, ScoresFollowTheModelsHorizon) {
  // The fixture's weights with "horizon" 16 instead of 64: the same expected hits now cover a
  // quarter of the tokens, so every score is four times the 64-token model's.
  std::ifstream in(kFixture + "/model.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = bytes.find("\"horizon\":\"64\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 14, "\"horizon\":\"16\"");
  const std::string path = ::testing::TempDir() + "/horizon16.safetensors";
  std::ofstream(path, std::ios::binary) << bytes;
  absl::StatusOr<std::shared_ptr<const JfModel>> short_model = JfModel::Load(path);
  ASSERT_THAT(short_model.status(), IsOk());
  ASSERT_EQ((*short_model)->geometry().horizon, 16u);

  const RoutingTrace trace = FixtureTrace();
  PredictorOptions short_options = LearnedOptions();
  short_options.learned = *short_model;
  absl::StatusOr<Predictor> long_horizon = Predictor::Create(LearnedOptions());
  absl::StatusOr<Predictor> short_horizon = Predictor::Create(short_options);
  ASSERT_THAT(long_horizon.status(), IsOk());
  ASSERT_THAT(short_horizon.status(), IsOk());
  for (Predictor* p : {&*long_horizon, &*short_horizon}) {
    p->NewSequence();
    for (size_t t = 0; t < 16; ++t) {
      ASSERT_THAT(p->Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t)), IsOk());
    }
    p->Refresh();
  }
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t e = 0; e < 8; ++e) {
      EXPECT_FLOAT_EQ(short_horizon->Score(l, e), 4.0f * long_horizon->Score(l, e)) << l << " " << e;
    }
  }
}

TEST(JfPredictorTest, EachScorerHasItsOwnDefaultMargin) {
  // The fixture carries no "hysteresis_margin": jF takes the swept default, v0 its own.
  const std::shared_ptr<const JfModel> model = FixtureModel();
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->hysteresis_margin(), kJfDefaultMargin);
  EXPECT_EQ(DefaultHysteresisMargin(model.get()), kJfDefaultMargin);
  EXPECT_EQ(DefaultHysteresisMargin(nullptr), 2.0f);
  EXPECT_LT(kJfDefaultMargin, kV0DefaultMargin);
}

TEST(JfPredictorTest, ObserveRefusesNormsOfTheWrongCount) {
  const RoutingTrace trace = FixtureTrace();
  absl::StatusOr<Predictor> predictor = Predictor::Create(LearnedOptions());
  ASSERT_THAT(predictor.status(), IsOk());
  const float one_norm[] = {1.0f};
  EXPECT_THAT(predictor->Observe(trace.TokenExperts(0), trace.TokenWeights(0), one_norm),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 input norms for 2 layers")));
}

// Two predictors fed the same routing, one of them saved and restored into a fresh predictor
// half-way, plan the same loads.
void ExpectRestoredPredictorPlansTheSame(PredictorOptions options) {
  const RoutingTrace trace = FixtureTrace();
  absl::StatusOr<Predictor> a = Predictor::Create(options);
  ASSERT_THAT(a.status(), IsOk());
  for (size_t t = 0; t < 40; ++t) {
    ASSERT_THAT(a->Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t)), IsOk());
    if (a->RefreshDue()) a->Refresh();
  }
  absl::StatusOr<Predictor> b = Predictor::Create(options);
  ASSERT_THAT(b->RestoreState(a->SaveState()), IsOk());
  EXPECT_EQ(b->tokens_observed(), 40u);
  for (uint32_t l = 0; l < 2; ++l) {
    std::vector<uint32_t> resident;
    for (uint32_t e = 0; e < 8; ++e) {
      if (a->IsResident(l, e)) resident.push_back(e);
    }
    ASSERT_THAT(b->SetResident(l, resident), IsOk());
  }
  int refreshes = 0;
  for (size_t t = 40; t < trace.num_tokens(); ++t) {
    ASSERT_THAT(a->Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t)), IsOk());
    ASSERT_THAT(b->Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t)), IsOk());
    ASSERT_EQ(a->RefreshDue(), b->RefreshDue());
    if (!a->RefreshDue()) continue;
    const PredictorPlan plan_a = a->Refresh();
    const PredictorPlan& plan_b = b->Refresh();
    ++refreshes;
    EXPECT_EQ(plan_a.desired, plan_b.desired);
    ASSERT_EQ(plan_a.loads.size(), plan_b.loads.size());
    for (size_t i = 0; i < plan_a.loads.size(); ++i) {
      EXPECT_EQ(plan_a.loads[i].expert, plan_b.loads[i].expert);
      EXPECT_EQ(plan_a.loads[i].gain, plan_b.loads[i].gain);
    }
    for (uint32_t e = 0; e < 8; ++e) EXPECT_EQ(a->Score(0, e), b->Score(0, e));
  }
  EXPECT_GE(refreshes, 4);
}

TEST(JfPredictorTest, RestoredLearnedPredictorPlansTheSame) { ExpectRestoredPredictorPlansTheSame(LearnedOptions()); }

TEST(JfPredictorTest, RestoredV0PredictorPlansTheSame) {
  PredictorOptions options = LearnedOptions();
  options.learned = nullptr;
  options.top_k = 0;
  ExpectRestoredPredictorPlansTheSame(options);
}

TEST(JfPredictorTest, RestoreRefusesAnotherScorerOrGeometry) {
  PredictorOptions v0 = LearnedOptions();
  v0.learned = nullptr;
  absl::StatusOr<Predictor> learned = Predictor::Create(LearnedOptions());
  absl::StatusOr<Predictor> plain = Predictor::Create(v0);
  ASSERT_THAT(learned.status(), IsOk());
  ASSERT_THAT(plain.status(), IsOk());
  EXPECT_THAT(plain->RestoreState(learned->SaveState()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("jF")));
  v0.experts_per_layer = 9;
  absl::StatusOr<Predictor> wider = Predictor::Create(v0);
  EXPECT_THAT(wider->RestoreState(plain->SaveState()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 layers x 8 experts")));
  const std::string bytes = learned->SaveState();
  EXPECT_THAT(learned->RestoreState(bytes.substr(0, bytes.size() / 2)), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  EXPECT_THAT(learned->RestoreState("garbage"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad magic")));
}

TEST(JfPredictorTest, ReplayRunsTheLearnedPredictorPerSequence) {
  const RoutingTrace trace = FixtureTrace();
  absl::StatusOr<ReplayResult> learned = Replay(trace, LearnedOptions());
  ASSERT_THAT(learned.status(), IsOk());
  // Sequences of 40, 25 and 50 tokens: 3 + 2 + 4 blocks of at most 16.
  EXPECT_EQ(learned->blocks, 9u);
  EXPECT_GT(learned->predictor_loads, 0u);
  EXPECT_LE(learned->predictor.calls, learned->oracle.calls);
}

// Experts 0 and 1 carry a long first request; the second request uses only 6 and 7. A large
// hysteresis margin keeps 0 and 1 resident on score alone.
std::vector<uint32_t> DesiredAfterTwoRequests(float request_share) {
  PredictorOptions options;
  options.num_layers = 1;
  options.experts_per_layer = 8;
  options.floating_slots = 2;
  options.read_budget = 100;
  options.hysteresis_margin = 10.0f;
  options.request_share = request_share;
  absl::StatusOr<Predictor> predictor = Predictor::Create(options);
  EXPECT_THAT(predictor.status(), IsOk());
  const float weights[] = {0.5f, 0.5f};
  predictor->NewSequence();
  for (int t = 0; t < 320; ++t) {
    const uint32_t experts[] = {0, 1};
    EXPECT_THAT(predictor->Observe(experts, weights), IsOk());
    if (predictor->RefreshDue()) predictor->Refresh();
  }
  predictor->NewSequence();
  for (int t = 0; t < 16; ++t) {
    const uint32_t experts[] = {6, 7};
    EXPECT_THAT(predictor->Observe(experts, weights), IsOk());
  }
  const PredictorPlan& plan = predictor->Refresh();
  std::vector<uint32_t> desired(plan.desired.begin(), plan.desired.begin() + plan.desired_count[0]);
  std::sort(desired.begin(), desired.end());
  return desired;
}

TEST(RequestShareTest, ReservesSlotsForTheRequestsHotExperts) {
  EXPECT_THAT(DesiredAfterTwoRequests(0.0f), ElementsAre(0u, 1u));
  // One slot reserved: 6 (tied with 7 on hits and score; the lower id), the other kept by 0.
  EXPECT_THAT(DesiredAfterTwoRequests(0.5f), ElementsAre(0u, 6u));
  EXPECT_THAT(DesiredAfterTwoRequests(1.0f), ElementsAre(6u, 7u));
}

TEST(RequestShareTest, OutOfRangeShareIsRefused) {
  PredictorOptions options;
  options.num_layers = 1;
  options.experts_per_layer = 8;
  options.request_share = 1.5f;
  EXPECT_THAT(Predictor::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("request_share 1.5")));
}

TEST(RoutingTraceV2Test, SequencesAndNormsRoundTrip) {
  const RoutingTrace trace = FixtureTrace();
  EXPECT_THAT(trace.sequence_starts, ElementsAre(0u, 40u, 65u));
  ASSERT_EQ(trace.input_sq_norms.size(), trace.num_tokens() * 2);
  absl::StatusOr<std::string> bytes = EncodeTrace(trace);
  ASSERT_THAT(bytes.status(), IsOk());
  absl::StatusOr<RoutingTrace> back = DecodeTrace(*bytes);
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ(back->sequence_starts, trace.sequence_starts);
  EXPECT_EQ(back->input_sq_norms, trace.input_sq_norms);
  EXPECT_EQ(back->experts, trace.experts);
  const auto sequences = back->Sequences();
  ASSERT_EQ(sequences.size(), 3u);
  EXPECT_EQ(sequences[1], std::make_pair(size_t{40}, size_t{65}));
}

TEST(RoutingTraceV2Test, BadSequenceStartsAndNormsAreRefused) {
  RoutingTrace trace = FixtureTrace();
  trace.sequence_starts = {0, 50, 40};
  EXPECT_THAT(EncodeTrace(trace).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence start 2")));
  trace.sequence_starts = {5};
  EXPECT_THAT(ValidateTrace(trace), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ascending from 0")));
  trace = FixtureTrace();
  trace.input_sq_norms[3] = -1.0f;
  EXPECT_THAT(ValidateTrace(trace), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad input norm")));
  trace.input_sq_norms.pop_back();
  EXPECT_THAT(ValidateTrace(trace), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input norms for")));
}

TEST(RoutingTraceV2Test, TruncatedSequenceTableIsDataLoss) {
  const RoutingTrace trace = FixtureTrace();
  absl::StatusOr<std::string> bytes = EncodeTrace(trace);
  ASSERT_THAT(bytes.status(), IsOk());
  // Header (28 bytes) + flags (4) + a sequence count claiming 2^40 starts.
  std::string bad = bytes->substr(0, 32);
  const uint64_t huge = uint64_t{1} << 40;
  bad.append(reinterpret_cast<const char*>(&huge), 8);
  EXPECT_THAT(DecodeTrace(bad).status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("sequence starts")));
}

TEST(RoutingTraceV2Test, ReportsWithNewSequenceIdsStartSequences) {
  RoutingTrace trace;
  trace.experts_per_layer = 4;
  std::optional<uint64_t> last;
  auto report = [](uint64_t sequence, float norm) {
    nq::v1::RoutingReport r;
    r.set_sequence_id(sequence);
    r.set_num_tokens(2);
    for (int t = 0; t < 2; ++t) {
      nq::v1::LayerRouting* entry = r.add_layer_entries();
      entry->set_layer(3);
      entry->add_experts(t);
      entry->add_weights(1.0f);
      entry->set_input_sq_norm(norm);
    }
    return r;
  };
  ASSERT_THAT(AppendRoutingReport(report(7, 2.0f), &trace, &last), IsOk());
  ASSERT_THAT(AppendRoutingReport(report(7, 2.0f), &trace, &last), IsOk());
  ASSERT_THAT(AppendRoutingReport(report(8, 3.0f), &trace, &last), IsOk());
  EXPECT_THAT(trace.sequence_starts, ElementsAre(0u, 4u));
  EXPECT_THAT(trace.input_sq_norms, ElementsAre(2, 2, 2, 2, 3, 3));
  // A report without norms (an older worker) drops them: a trace's norms are all or none.
  ASSERT_THAT(AppendRoutingReport(report(8, 0.0f), &trace, &last), IsOk());
  EXPECT_TRUE(trace.input_sq_norms.empty());
  EXPECT_THAT(ValidateTrace(trace), IsOk());
}

}  // namespace
}  // namespace nq::streamer
