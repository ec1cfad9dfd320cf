#include "services/streamer/report_order.h"

#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {

using ::nq::testing::IsOkAndHolds;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

nq::v1::RoutingReport Report(uint64_t sequence, uint64_t first, uint32_t tokens) {
  nq::v1::RoutingReport report;
  report.set_sequence_id(sequence);
  report.set_first_token(first);
  report.set_num_tokens(tokens);
  return report;
}

TEST(ReportOrderTest, FollowsBlocksSequencesAndGaps) {
  ReportOrder order;
  // A session may open in the middle of a sequence.
  EXPECT_THAT(order.Accept(Report(4, 32, 16)), IsOkAndHolds(ReportPlace::kFirst));
  EXPECT_THAT(order.Accept(Report(4, 48, 16)), IsOkAndHolds(ReportPlace::kNext));
  EXPECT_THAT(order.Accept(Report(4, 96, 3)), IsOkAndHolds(ReportPlace::kAfterGap));
  EXPECT_THAT(order.Accept(Report(6, 0, 16)), IsOkAndHolds(ReportPlace::kNewSequence));
  EXPECT_THAT(order.Accept(Report(6, 16, 1)), IsOkAndHolds(ReportPlace::kNext));
}

TEST(ReportOrderTest, RefusesStaleRepeatedAndEmptyReportsWithoutMovingTheCursor) {
  ReportOrder order;
  ASSERT_THAT(order.Accept(Report(2, 0, 16)), IsOkAndHolds(ReportPlace::kFirst));
  EXPECT_THAT(order.Accept(Report(1, 16, 16)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence 1 after sequence 2 (stale)")));
  EXPECT_THAT(order.Accept(Report(2, 8, 16)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already reported up to 16 (repeated)")));
  EXPECT_THAT(order.Accept(Report(2, 0, 16)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeated")));
  EXPECT_THAT(order.Accept(Report(2, 16, 0)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_tokens 0")));
  // None of those moved it: the true next block is still next.
  EXPECT_THAT(order.Accept(Report(2, 16, 16)), IsOkAndHolds(ReportPlace::kNext));
}

TEST(ReportOrderTest, RefusesAReportWhoseTokensWrapTheCount) {
  // Found by the routing_report fuzzer: next_token_ wrapped to 0, so the same report was taken
  // again as a later block.
  ReportOrder order;
  const uint64_t last = std::numeric_limits<uint64_t>::max();
  EXPECT_THAT(order.Accept(Report(1, last - 3, 16)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows the token count")));
  EXPECT_THAT(order.Accept(Report(1, last - 16, 16)), IsOkAndHolds(ReportPlace::kFirst));
  EXPECT_THAT(order.Accept(Report(1, last - 16, 16)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeated")));
}

}  // namespace
}  // namespace nq::streamer
