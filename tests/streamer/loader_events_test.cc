#include "services/streamer/loader_events.h"

#include <gtest/gtest.h>

#include <variant>

#include "services/common/metrics/registry.h"

namespace nq::streamer {
namespace {

nq::v1::RoutingReport Report(uint64_t first_token) {
  nq::v1::RoutingReport report;
  report.set_first_token(first_token);
  return report;
}

nq::v1::UnmapAck Ack(uint64_t generation) {
  nq::v1::UnmapAck ack;
  ack.set_generation(generation);
  return ack;
}

// Issue #22: the queue between a worker's session and its loader grew without bound when the
// worker reported faster than the loader read. Past the bound, reports are dropped and
// counted; acks are always kept, in order.
TEST(LoaderEventsTest, ReportsPastTheBoundAreDroppedAndCountedAcksAreKept) {
  metrics::Registry registry;
  metrics::Counter& dropped = registry.Counter("nq_test_reports_dropped_total", "dropped").Get();
  LoaderEvents events(/*max_reports=*/3, &dropped);
  for (uint64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(events.PushReport(Report(16 * i)), i < 3) << i;
    events.PushAck(Ack(i));
  }
  EXPECT_EQ(events.queued_reports(), 3u);
  EXPECT_EQ(events.dropped_reports(), 2u);
  EXPECT_EQ(dropped.Value(), 2);
  EXPECT_NE(registry.Serialize().find("\nnq_test_reports_dropped_total 2\n"), std::string::npos)
      << registry.Serialize();

  // Arrival order: report 0, ack 0, report 16, ack 1, report 32, ack 2, ack 3, ack 4.
  std::deque<LoaderEvents::Event> taken = events.TakeAll();
  ASSERT_EQ(taken.size(), 8u);
  std::vector<uint64_t> reports, acks;
  for (const LoaderEvents::Event& event : taken) {
    if (const auto* report = std::get_if<nq::v1::RoutingReport>(&event)) {
      EXPECT_EQ(acks.size(), reports.size()) << "a report out of its place";
      reports.push_back(report->first_token());
    } else {
      acks.push_back(std::get<nq::v1::UnmapAck>(event).generation());
    }
  }
  EXPECT_EQ(reports, (std::vector<uint64_t>{0, 16, 32}));
  EXPECT_EQ(acks, (std::vector<uint64_t>{0, 1, 2, 3, 4}));

  // Once the loader has taken them, the room is back.
  EXPECT_EQ(events.queued_reports(), 0u);
  EXPECT_TRUE(events.PushReport(Report(80)));
  EXPECT_EQ(events.TakeAll().size(), 1u);
  EXPECT_EQ(dropped.Value(), 2);
}

TEST(LoaderEventsTest, ABoundOfZeroStillTakesOneReport) {
  LoaderEvents events(/*max_reports=*/0, nullptr);
  EXPECT_TRUE(events.PushReport(Report(0)));
  EXPECT_FALSE(events.PushReport(Report(16)));
  EXPECT_EQ(events.dropped_reports(), 1u);
}

}  // namespace
}  // namespace nq::streamer
