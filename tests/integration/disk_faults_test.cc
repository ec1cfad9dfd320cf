// Disk faults under a serving cluster (issue #22): the streamer injects EIO and short reads into
// its record reads (--inject_read_faults), and the cluster keeps serving: every request
// answers, the failed records are counted by reason and never become READY, the worker's check
// of every READY slot against its record (--verify_slots) finds nothing wrong, and the records
// that did land still run their experts at 4 bits.
#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

TEST_F(ServingTest, InjectedDiskFaultsLeaveExpertsAtTwoBitsAndTheClusterServing) {
  streamer_extra_ = {"--inject_read_faults=eio=0.25,short=0.25,seed=5"};
  StartCluster({}, /*streamed=*/true);
  const char* prompts[] = {"def parse(", "class Node:\n    def __init__(self", "import os\nfor root, dirs",
                           "    return sorted(", "while True:\n    line = "};
  for (int round = 0; round < 2; ++round) {
    for (const char* prompt : prompts) {
      absl::StatusOr<std::pair<int, Json>> reply = PostJson(
          "/v1/completions", {{"model", "embedded"}, {"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}});
      ASSERT_TRUE(reply.ok()) << reply.status();
      EXPECT_EQ(reply->first, 200) << reply->second.dump();
      EXPECT_EQ(reply->second["usage"]["completion_tokens"], 24) << reply->second.dump();
    }
  }
  const int s = streamer_ports_.http, w = worker_ports_.http;
  EXPECT_TRUE(WaitFor([&] { return Metric(s, "nq_streamer_read_errors_total{reason=\"io_error\"}") > 0 &&
                                   Metric(s, "nq_streamer_read_errors_total{reason=\"short_read\"}") > 0; },
                      std::chrono::seconds(10)))
      << HttpGet(s, "/metrics").body;
  const double failed = Metric(s, "nq_streamer_slot_loads_total{result=\"failed\"}");
  EXPECT_GE(failed, Metric(s, "nq_streamer_read_errors_total{reason=\"io_error\"}") +
                        Metric(s, "nq_streamer_read_errors_total{reason=\"short_read\"}"));
  EXPECT_GT(Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}"), 0) << "no record landed at all";
  EXPECT_GT(Metric(s, "nq_streamer_expert_calls_total{bits=\"4\"}"), 0);
  EXPECT_EQ(Metric(w, "nq_worker_slot_integrity_failures_total"), 0) << "a READY slot differs from its record";
  EXPECT_EQ(streamer_->Log().find("injecting disk faults") != std::string::npos, true) << streamer_->Log();
}

// Reads taking seconds (a stalled drive): every record read is held 8 s. Requests are answered
// meanwhile, at 2 bits (nothing is READY yet while reads are in flight), the slow reads are
// counted, and when they land the streamer carries on: the records become READY, intact.
TEST_F(ServingTest, SlowDiskReadsLeaveGenerationGoingAtTwoBits) {
  streamer_extra_ = {"--inject_read_faults=slow=1:8000,seed=3"};
  StartCluster({}, /*streamed=*/true);
  const int s = streamer_ports_.http, w = worker_ports_.http;
  absl::StatusOr<std::pair<int, Json>> reply = PostJson(
      "/v1/completions", {{"model", "embedded"}, {"prompt", "def parse("}, {"max_tokens", 24}, {"temperature", 0}});
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->first, 200) << reply->second.dump();
  EXPECT_EQ(reply->second["usage"]["completion_tokens"], 24) << reply->second.dump();
  // Answered while the fixed sets' reads were still held by the disk: nothing READY, reads out.
  EXPECT_EQ(Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}"), 0) << HttpGet(s, "/metrics").body;
  EXPECT_GT(Metric(s, "nq_streamer_read_queue_depth"), 0) << HttpGet(s, "/metrics").body;
  // The held reads land, are counted as slow, and their records become READY.
  EXPECT_TRUE(WaitFor([&] { return Metric(s, "nq_streamer_slot_loads_total{result=\"ready\"}") > 0; },
                      std::chrono::seconds(30)))
      << HttpGet(s, "/metrics").body;
  EXPECT_GT(Metric(s, "nq_streamer_read_faults_injected_total{kind=\"slow\"}"), 0);
  EXPECT_GT(Metric(s, "nq_streamer_slow_reads_total"), 0);
  EXPECT_EQ(Metric(s, "nq_streamer_slot_loads_total{result=\"failed\"}"), 0);
  reply = PostJson("/v1/completions",
                   {{"model", "embedded"}, {"prompt", "class Node:\n    def __init__(self"}, {"max_tokens", 24}, {"temperature", 0}});
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->first, 200) << reply->second.dump();
  EXPECT_EQ(Metric(w, "nq_worker_slot_integrity_failures_total"), 0) << "a READY slot differs from its record";
}

}  // namespace
}  // namespace nq::testing
