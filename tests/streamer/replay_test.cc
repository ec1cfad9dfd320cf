#include "services/streamer/replay.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "services/streamer/routing_trace.h"
#include "services/streamer/routing_trace_synthetic.h"
#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

RoutingTrace SmallTrace() {
  SyntheticTraceOptions options;
  options.num_layers = 3;
  options.experts_per_layer = 16;
  options.top_k = 2;
  options.num_tokens = 5;
  RoutingTrace trace = MakeSyntheticTrace(options);
  trace.layer_ids = {3, 4, 7};
  return trace;
}

void ExpectSameTrace(const RoutingTrace& a, const RoutingTrace& b) {
  EXPECT_EQ(a.layer_ids, b.layer_ids);
  EXPECT_EQ(a.experts_per_layer, b.experts_per_layer);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.experts, b.experts);
  EXPECT_EQ(a.weights, b.weights);
}

TEST(RoutingTraceTest, RoundTripsThroughBytesAndFile) {
  const RoutingTrace trace = SmallTrace();
  ASSERT_EQ(trace.num_tokens(), 5u);
  absl::StatusOr<std::string> bytes = EncodeTrace(trace);
  ASSERT_THAT(bytes, IsOk());
  // Header 28, flags 4, sequence count 8 (none), layer ids 12, records without norms.
  EXPECT_EQ(bytes->size(), 28u + 4 + 8 + 3 * 4 + 5 * 3 * 2 * 6);
  absl::StatusOr<RoutingTrace> decoded = DecodeTrace(*bytes);
  ASSERT_THAT(decoded, IsOk());
  ExpectSameTrace(trace, *decoded);

  const std::string path = ::testing::TempDir() + absl::StrCat("/trace_", getpid(), ".nqrt");
  ASSERT_THAT(WriteTrace(trace, path), IsOk());
  absl::StatusOr<RoutingTrace> read = ReadTrace(path);
  ASSERT_THAT(read, IsOk());
  ExpectSameTrace(trace, *read);
  std::remove(path.c_str());
}

TEST(RoutingTraceTest, HeaderIsLittleEndian) {
  absl::StatusOr<std::string> bytes = EncodeTrace(SmallTrace());
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(bytes->substr(0, 8), std::string("NQRT\x02\x00\x00\x00", 8));
  EXPECT_EQ(bytes->substr(8, 4), std::string("\x03\x00\x00\x00", 4));  // layers
  EXPECT_EQ(bytes->substr(12, 4), std::string("\x10\x00\x00\x00", 4));  // experts
}

TEST(RoutingTraceTest, RejectsBadMagic) {
  std::string bytes = *EncodeTrace(SmallTrace());
  bytes[0] = 'X';
  EXPECT_THAT(DecodeTrace(bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
}

TEST(RoutingTraceTest, RejectsWrongVersion) {
  std::string bytes = *EncodeTrace(SmallTrace());
  bytes[4] = 3;
  EXPECT_THAT(DecodeTrace(bytes), StatusIs(absl::StatusCode::kUnimplemented,
                                           HasSubstr("unsupported trace version 3")));
}

TEST(RoutingTraceTest, ReadsVersion1) {
  // Version 1: no flags, no sequence table, no norms (one sequence).
  std::string bytes = *EncodeTrace(SmallTrace());
  bytes.erase(28, 12);
  bytes[4] = 1;
  absl::StatusOr<RoutingTrace> decoded = DecodeTrace(bytes);
  ASSERT_THAT(decoded, IsOk());
  ExpectSameTrace(SmallTrace(), *decoded);
  EXPECT_TRUE(decoded->sequence_starts.empty());
  EXPECT_TRUE(decoded->input_sq_norms.empty());
}

TEST(RoutingTraceTest, EveryTruncationIsDataLoss) {
  const std::string bytes = *EncodeTrace(SmallTrace());
  EXPECT_THAT(DecodeTrace(bytes.substr(0, 2)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated reading magic")));
  EXPECT_THAT(DecodeTrace(bytes.substr(0, 6)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated reading version")));
  EXPECT_THAT(DecodeTrace(bytes.substr(0, 20)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated reading header")));
  EXPECT_THAT(DecodeTrace(bytes.substr(0, 30)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated reading flags and sequence count")));
  EXPECT_THAT(DecodeTrace(bytes.substr(0, 42)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated reading layer ids")));
  EXPECT_THAT(DecodeTrace(bytes.substr(0, bytes.size() - 1)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated reading records")));
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THAT(DecodeTrace(bytes.substr(0, n)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")))
        << n << " bytes";
  }
}

TEST(RoutingTraceTest, RejectsTrailingBytesAndBadIds) {
  std::string bytes = *EncodeTrace(SmallTrace());
  EXPECT_THAT(DecodeTrace(bytes + "x"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("1 trailing bytes")));
  bytes[52] = 99;  // first record's first expert id (header 28 + flags 4 + count 8 + layer ids 12)
  EXPECT_THAT(DecodeTrace(bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert id 99 out of range")));
}

TEST(RoutingTraceTest, ReadReportsMissingFile) {
  EXPECT_THAT(ReadTrace("/nonexistent/trace.nqrt"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/trace.nqrt")));
}

TEST(RoutingTraceTest, AppendsRoutingReports) {
  nq::v1::RoutingReport report;
  report.set_num_tokens(2);
  for (uint32_t t = 0; t < 2; ++t) {
    for (uint32_t layer : {3u, 5u}) {
      nq::v1::LayerRouting* entry = report.add_layer_entries();
      entry->set_layer(layer);
      entry->add_experts(t + layer);
      entry->add_experts(t);
      entry->add_weights(0.75f);
      entry->add_weights(0.25f);
    }
  }
  RoutingTrace trace;
  trace.experts_per_layer = 8;
  ASSERT_THAT(AppendRoutingReport(report, &trace), IsOk());
  ASSERT_THAT(AppendRoutingReport(report, &trace), IsOk());
  EXPECT_EQ(trace.layer_ids, (std::vector<uint32_t>{3, 5}));
  EXPECT_EQ(trace.top_k, 2u);
  EXPECT_EQ(trace.num_tokens(), 4u);
  EXPECT_EQ(trace.TokenExperts(1)[0], 4u);  // token 1, layer 3, first expert
  EXPECT_EQ(trace.TokenExperts(1)[2], 6u);  // token 1, layer 5
  EXPECT_THAT(ValidateTrace(trace), IsOk());

  nq::v1::RoutingReport wrong_layer = report;
  wrong_layer.mutable_layer_entries(1)->set_layer(6);
  EXPECT_THAT(AppendRoutingReport(wrong_layer, &trace),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is layer 6, expected 5")));
  nq::v1::RoutingReport out_of_range = report;
  out_of_range.mutable_layer_entries(0)->set_experts(0, 8);
  EXPECT_THAT(AppendRoutingReport(out_of_range, &trace),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert 8 out of range")));
  EXPECT_EQ(trace.num_tokens(), 4u);  // failed appends leave the trace unchanged
}

PredictorOptions ReplayOptions(uint32_t f) {
  PredictorOptions options;
  options.floating_slots = f;
  options.read_budget = 1000;
  return options;
}

TEST(ReplayTest, OracleBoundsTheOtherPolicies) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SyntheticTraceOptions trace_options;
    trace_options.num_layers = 4;
    trace_options.experts_per_layer = 32;
    trace_options.top_k = 4;
    trace_options.num_tokens = 400;
    trace_options.zipf_exponent = seed % 3 == 0 ? 0.0 : 0.8;
    trace_options.drift_interval = 32;
    trace_options.drift_swaps = 6;
    trace_options.seed = seed;
    const RoutingTrace trace = MakeSyntheticTrace(trace_options);
    PredictorOptions options = ReplayOptions(6);
    options.fixed = {{0}, {1, 2}, {}, {3}};
    options.read_budget = 3 + seed;
    absl::StatusOr<ReplayResult> result = Replay(trace, options);
    ASSERT_THAT(result, IsOk());
    EXPECT_EQ(result->blocks, 25u);
    EXPECT_EQ(result->calls, 400u * 4 * 4);
    EXPECT_GE(result->oracle.calls, result->predictor.calls) << seed;
    EXPECT_GE(result->oracle.calls, result->previous_block.calls) << seed;
    EXPECT_GE(result->oracle.weight, result->predictor.weight) << seed;
    EXPECT_GE(result->oracle.weight, result->previous_block.weight) << seed;
    EXPECT_GT(result->predictor.calls, 0.0);
    EXPECT_LT(result->oracle.calls, 1.0);
  }
}

// Refreshing more often cuts the trace into more, shorter blocks for every policy; the oracle,
// which picks each block's own top-F, can only gain from shorter blocks on a drifting trace.
TEST(ReplayTest, BlocksFollowTheRefreshInterval) {
  const RoutingTrace trace = MakeSyntheticTrace({.num_layers = 2,
                                                 .experts_per_layer = 32,
                                                 .top_k = 4,
                                                 .num_tokens = 402,
                                                 .zipf_exponent = 0.8,
                                                 .drift_interval = 8,
                                                 .drift_swaps = 6});
  double oracle_before = 0;
  for (uint32_t interval : {16u, 4u, 1u}) {
    PredictorOptions options = ReplayOptions(6);
    options.refresh_interval = interval;
    absl::StatusOr<ReplayResult> result = Replay(trace, options);
    ASSERT_THAT(result, IsOk());
    EXPECT_EQ(result->blocks, (402u + interval - 1) / interval) << interval;
    EXPECT_GE(result->oracle.calls, oracle_before) << interval;
    EXPECT_GE(result->oracle.calls, result->predictor.calls) << interval;
    oracle_before = result->oracle.calls;
  }
  // One token a block: its own top-F (F = 6 >= top_k) holds every call.
  EXPECT_DOUBLE_EQ(oracle_before, 1.0);
  PredictorOptions zero = ReplayOptions(6);
  zero.refresh_interval = 0;
  EXPECT_THAT(Replay(trace, zero), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("refresh_interval")));
}

TEST(ReplayTest, EverythingAtFourBitsWhenSlotsCoverAllExperts) {
  SyntheticTraceOptions trace_options;
  trace_options.num_layers = 2;
  trace_options.experts_per_layer = 16;
  trace_options.top_k = 4;
  trace_options.num_tokens = 100;
  const RoutingTrace trace = MakeSyntheticTrace(trace_options);
  for (uint32_t f : {16u, 20u}) {
    absl::StatusOr<ReplayResult> result = Replay(trace, ReplayOptions(f));
    ASSERT_THAT(result, IsOk());
    EXPECT_DOUBLE_EQ(result->oracle.calls, 1.0);
    EXPECT_DOUBLE_EQ(result->previous_block.calls, 1.0);
    EXPECT_DOUBLE_EQ(result->predictor.calls, 1.0);
    EXPECT_DOUBLE_EQ(result->oracle.weight, 1.0);
    EXPECT_DOUBLE_EQ(result->previous_block.weight, 1.0);
    EXPECT_DOUBLE_EQ(result->predictor.weight, 1.0);
  }
}

TEST(ReplayTest, PredictorReachesTheOracleOnAStableHotSet) {
  // Every token routes among the same 8 experts per layer: the oracle serves everything and
  // the predictor should too, after its first block.
  RoutingTrace trace;
  trace.layer_ids = {0, 1};
  trace.experts_per_layer = 32;
  trace.top_k = 4;
  for (uint32_t t = 0; t < 1600; ++t) {
    for (uint32_t l = 0; l < 2; ++l) {
      for (uint32_t j = 0; j < 4; ++j) {
        trace.experts.push_back(10 + l + 2 * ((t + 3 * j) % 8));
        trace.weights.push_back(0.25f);
      }
    }
  }
  ASSERT_THAT(ValidateTrace(trace), IsOk());
  absl::StatusOr<ReplayResult> result = Replay(trace, ReplayOptions(8));
  ASSERT_THAT(result, IsOk());
  EXPECT_DOUBLE_EQ(result->oracle.calls, 1.0);
  EXPECT_GE(result->predictor.calls, result->oracle.calls - 0.01);  // block 0 of 100 misses
  EXPECT_GE(result->predictor.weight, result->oracle.weight - 0.01);
}

// Loads that land late: one layer, one floating slot, one expert a token. Block A routes to
// expert 1 (the slot holds expert 0, nothing served), so the previous-block policy loads 1 for
// block B, whose first 4 tokens route to 0 and the other 12 to 1. Instantly landed, expert 1
// serves B's 12 calls to it and 0 is gone; landing after 4 tokens, 0 still serves B's first 4
// (the replacement lands in the staging slot) and 1 the 12 after: 16. Landing after 8, expert 1
// misses 4 of its calls: 12 again.
TEST(ReplayTest, ALoadServesOnlyAfterItLandsAndItsVictimUntilThen) {
  RoutingTrace trace;
  trace.layer_ids = {0};
  trace.experts_per_layer = 4;
  trace.top_k = 1;
  for (uint32_t t = 0; t < 32; ++t) {
    trace.experts.push_back(t < 16 ? 1 : (t < 20 ? 0 : 1));
    trace.weights.push_back(1.0f);
  }
  ASSERT_THAT(ValidateTrace(trace), IsOk());
  for (const auto& [landing, served] : {std::pair{0u, 12.0}, {4u, 16.0}, {8u, 12.0}, {16u, 4.0}}) {
    absl::StatusOr<ReplayResult> result = Replay(trace, ReplayOptions(1), landing);
    ASSERT_THAT(result, IsOk());
    EXPECT_DOUBLE_EQ(result->previous_block.calls, served / 32) << "landing " << landing;
    EXPECT_DOUBLE_EQ(result->oracle.calls, 28.0 / 32) << "the oracle lands instantly";
  }
}

TEST(ReplayTest, RejectsOptionsForAnotherShape) {
  PredictorOptions options = ReplayOptions(4);
  options.num_layers = 7;
  EXPECT_THAT(Replay(SmallTrace(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the trace has 3 x 16")));
}

}  // namespace
}  // namespace nq::streamer
