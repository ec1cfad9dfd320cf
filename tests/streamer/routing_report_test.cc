// routing_report.h: a worker's routing report is checked whole before the predictor sees it.
#include "services/streamer/routing_report.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// `tokens` tokens over `layers`, top-2, experts (t + l) % 8 and (t + l + 1) % 8.
nq::v1::RoutingReport Report(const std::vector<uint32_t>& layers, uint32_t tokens) {
  nq::v1::RoutingReport report;
  report.set_num_tokens(tokens);
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t l = 0; l < layers.size(); ++l) {
      nq::v1::LayerRouting* entry = report.add_layer_entries();
      entry->set_layer(layers[l]);
      entry->add_experts((t + l) % 8);
      entry->add_experts((t + l + 1) % 8);
      entry->add_weights(0.6f);
      entry->add_weights(0.4f);
    }
  }
  return report;
}

TEST(RoutingReportTest, WellFormedReportPasses) {
  const nq::v1::RoutingReport report = Report({1, 2, 5}, 4);
  absl::StatusOr<std::vector<uint32_t>> layers = ReportLayers(report);
  ASSERT_THAT(layers.status(), IsOk());
  EXPECT_THAT(*layers, ElementsAre(1, 2, 5));
  EXPECT_THAT(CheckReport(report, *layers, 8), IsOk());
}

TEST(RoutingReportTest, EveryBrokenRuleIsRefusedByName) {
  EXPECT_THAT(ReportLayers(nq::v1::RoutingReport()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not token-major")));
  const std::vector<uint32_t> layers = {1, 2, 5};
  nq::v1::RoutingReport report = Report(layers, 4);
  report.set_num_tokens(5);
  EXPECT_THAT(CheckReport(report, layers, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("12 entries for 5 tokens x 3 layers")));
  report = Report(layers, 4);
  report.mutable_layer_entries(7)->set_experts(1, 8);  // token 2, layer 2
  EXPECT_THAT(CheckReport(report, layers, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 2 layer 2: expert 8 out of range")));
  report = Report(layers, 4);
  report.mutable_layer_entries(10)->add_experts(3);  // experts without weights, and a wider entry
  EXPECT_THAT(CheckReport(report, layers, 8), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 3 layer 2")));
  report = Report(layers, 4);
  report.mutable_layer_entries(4)->set_layer(9);
  EXPECT_THAT(CheckReport(report, layers, 8), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 1 layer 9")));
  // The same width in every entry: a later token of another top-k would stop the predictor halfway.
  report = Report(layers, 4);
  for (int i = 9; i < 12; ++i) {
    report.mutable_layer_entries(i)->mutable_experts()->RemoveLast();
    report.mutable_layer_entries(i)->mutable_weights()->RemoveLast();
  }
  EXPECT_THAT(CheckReport(report, layers, 8), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 3")));
  report = Report({1}, 1);
  report.mutable_layer_entries(0)->clear_experts();
  report.mutable_layer_entries(0)->clear_weights();
  EXPECT_THAT(CheckReport(report, std::vector<uint32_t>{1}, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no experts")));
}

}  // namespace
}  // namespace nq::streamer
