// A soak of the CPU cluster (issue #22): 1000 requests from 4 clients at once against a router
// whose queue holds one waiting request: completions and chat, streamed and not, clients that
// hang up mid-stream, malformed and invalid bodies. Every request must be answered (200, 400
// or 429; none hangs or gets a 5xx), the router's /metrics must account for every answer by
// status code, and each service's resident memory and open file descriptors must stay flat
// after the warm-up (within 10 %, or 4 descriptors).
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

struct Usage {
  double rss_kib = 0;
  int fds = 0;
};

Usage UsageOf(pid_t pid) {
  Usage u;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) u.rss_kib = std::stod(line.substr(6));
  }
  if (DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    while (readdir(dir) != nullptr) ++u.fds;
    closedir(dir);
    u.fds -= 2;  // . and ..
  }
  return u;
}

TEST_F(ServingTest, ThousandMixedRequestsAreAllAnsweredAndAccountedWithFlatResources) {
  StartCluster({"--max_waiting=1"}, /*streamed=*/true);
  constexpr int kClients = 4, kPerClient = 250, kWarmup = 200;
  std::mutex mu;
  std::map<int, int> answered;  // by status code
  int hung_up = 0;
  std::atomic<int> sent{0};
  std::map<std::string, Usage> warm;
  std::atomic<bool> warm_taken{false};
  auto take_warm = [&] {
    bool expected = false;
    if (!warm_taken.compare_exchange_strong(expected, true)) return;
    warm = {{"router", UsageOf(router_->pid())}, {"worker", UsageOf(worker_->pid())},
            {"streamer", UsageOf(streamer_->pid())}};
  };
  auto client = [&](int c) {
    for (int i = 0; i < kPerClient; ++i) {
      const int n = sent.fetch_add(1);
      if (n == kWarmup) take_warm();
      const Json completion = {{"model", "embedded"}, {"prompt", absl::StrCat("def f", n, "(")},
                               {"max_tokens", 3}, {"temperature", 0.5}, {"seed", n}};
      const Json chat = {{"model", "embedded"},
                         {"messages", Json::array({{{"role", "user"}, {"content", absl::StrCat("hi ", n)}}})},
                         {"max_tokens", 3}};
      std::string path = "/v1/completions", body;
      bool stream = false, hang_up = false;
      switch ((c + i) % 10) {
        case 0: case 1: case 2: case 3: body = completion.dump(); break;
        case 4: case 5: { Json b = completion; b["stream"] = true; body = b.dump(); stream = true; break; }
        case 6: path = "/v1/chat/completions"; body = chat.dump(); break;
        case 7: { Json b = completion; b["stream"] = true; b["max_tokens"] = 64; body = b.dump(); hang_up = true; break; }
        case 8: body = "{\"model\": \"embedded\", \"prompt\": "; break;  // malformed JSON
        default: { Json b = completion; b["max_tokens"] = -5; body = b.dump(); break; }  // invalid field
      }
      absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, path, body);
      ASSERT_TRUE(http.ok()) << http.status();
      absl::StatusOr<int> status = http->Status();
      ASSERT_TRUE(status.ok()) << "request " << n << " got no answer: " << status.status();
      if (*status == 200 && hang_up) {
        (void)http->NextEvent();  // one token, then the client leaves
        http->Close();
        std::lock_guard<std::mutex> lock(mu);
        ++hung_up;
      } else if (*status == 200 && stream) {
        while (true) {
          absl::StatusOr<std::string> event = http->NextEvent();
          ASSERT_TRUE(event.ok()) << "request " << n << ": the stream broke: " << event.status();
          if (*event == "[DONE]") break;
          EXPECT_EQ(event->find("\"error\""), std::string::npos) << "request " << n << ": " << *event;
        }
      } else {
        (void)http->Body();
      }
      std::lock_guard<std::mutex> lock(mu);
      ++answered[*status];
    }
  };
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) clients.emplace_back(client, c);
  for (std::thread& t : clients) t.join();

  std::string summary;
  for (const auto& [code, count] : answered) absl::StrAppend(&summary, " ", code, ": ", count);
  std::printf("soak: answers by status%s; streams the client hung up: %d\n", summary.c_str(), hung_up);
  int total = 0;
  for (const auto& [code, count] : answered) {
    EXPECT_TRUE(code == 200 || code == 400 || code == 429) << count << " answers with " << code;
    total += count;
  }
  EXPECT_EQ(total, kClients * kPerClient);
  EXPECT_GT(answered[200], 0);
  EXPECT_GT(answered[400], 0);
  EXPECT_GT(answered[429], 0) << "the queue never filled: the soak did not reach the refusal path";
  // The router's metrics account for every answer (a hung-up stream is logged once the worker
  // notices, so wait for the counts to catch up).
  const int r = router_ports_.http;
  EXPECT_TRUE(WaitFor(
      [&] {
        return Metric(r, "nq_http_responses_total{code=\"200\"}") == answered[200] &&
               Metric(r, "nq_http_responses_total{code=\"400\"}") == answered[400] &&
               Metric(r, "nq_http_responses_total{code=\"429\"}") == answered[429];
      },
      std::chrono::seconds(10)))
      << HttpGet(r, "/metrics").body;
  EXPECT_EQ(Metric(r, "nq_requests_rejected_total"), answered[429]);
  EXPECT_GT(hung_up, 0);

  // Resources after the soak against after the warm-up.
  const std::map<std::string, pid_t> pids = {
      {"router", router_->pid()}, {"worker", worker_->pid()}, {"streamer", streamer_->pid()}};
  for (const auto& [name, pid] : pids) {
    const Usage now = UsageOf(pid), before = warm[name];
    EXPECT_LE(now.rss_kib, before.rss_kib * 1.10) << name << " resident memory grew from " << before.rss_kib
                                                  << " to " << now.rss_kib << " KiB";
    EXPECT_LE(now.fds, std::max(before.fds + 4, static_cast<int>(before.fds * 1.10)))
        << name << " open descriptors grew from " << before.fds << " to " << now.fds;
  }
}

}  // namespace
}  // namespace nq::testing
