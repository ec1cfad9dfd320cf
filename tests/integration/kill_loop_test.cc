// The streamer killed again and again under load (issue #22): 20 SIGKILLs of nq-streamer while
// at least 50 streaming requests run one after another (more when a slow machine's restarts let
// the killer fall behind, so all 20 kills always land under load). Every request must finish with all its tokens
// and no error event (generation goes on at 2 bits while the streamer is down), and the
// worker's check of every READY slot against its record (--verify_slots) must find nothing
// wrong across the restarts, the adoptions of READY slots and the reloads.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

TEST_F(ServingTest, FiftyStreamsSurviveTwentyStreamerKills) {
  StartCluster({}, /*streamed=*/true);
  constexpr int kRequests = 50, kKills = 20, kMaxRequests = 200;
  std::atomic<int> finished{0};
  std::atomic<bool> done{false};
  std::atomic<int> kills{0};
  // The killer paces itself by the requests: about one kill per 2.5 requests, each at a random
  // point of a request (the streamer may be mid-load, mid-update or idle), then a restart on
  // the same port, which the worker reconnects to.
  std::thread killer([&] {
    int next_at = 1;
    while (kills < kKills && !done.load()) {
      if (finished.load() < next_at) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(30 * (kills.load() % 5)));
      streamer_->Signal(SIGKILL);
      (void)streamer_->WaitForExit(std::chrono::seconds(5));
      streamer_.emplace(StartStreamer(streamer_ports_, StreamerFlags(true)));
      const int k = kills.fetch_add(1) + 1;
      next_at = finished.load() + 1 + (k % 3 == 0 ? 1 : 0) + (k % 2);
    }
  });
  const char* prompts[] = {"def quicksort(", "import json\n", "class Tree:\n", "for i in range(", "# parse the"};
  // Requests keep coming until every kill has landed: a restart takes longer than a request
  // on a loaded machine, and a killer that ran out of requests would test fewer kills.
  for (int i = 0; i < kMaxRequests && (i < kRequests || kills.load() < kKills); ++i) {
    const Streamed s = Stream("/v1/completions", {{"model", "embedded"},
                                                  {"prompt", prompts[i % 5]},
                                                  {"max_tokens", 20},
                                                  {"temperature", 0.7},
                                                  {"seed", i},
                                                  {"ignore_eos", true}});
    EXPECT_EQ(s.finish, "length") << "request " << i;
    EXPECT_EQ(s.usage.value("completion_tokens", 0), 20) << "request " << i;
    for (const Json& chunk : s.chunks) EXPECT_FALSE(chunk.contains("error")) << "request " << i << ": " << chunk;
    finished.fetch_add(1);
  }
  done.store(true);
  killer.join();
  EXPECT_EQ(kills.load(), kKills) << "the requests finished before the kills did";
  // The last streamer is up and the worker back with it; nothing READY ever differed from its
  // record and no update was refused.
  EXPECT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_streamer_connected") == 1; },
                      std::chrono::seconds(20)))
      << worker_->Log();
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0) << worker_->Log();
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_updates_rejected_total"), 0) << worker_->Log();
}

}  // namespace
}  // namespace nq::testing
