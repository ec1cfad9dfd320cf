// Runs the real Prometheus checker over an exposition exercising every feature of the library:
// `promtool check metrics` parses the text exactly as a Prometheus server would and lints it
// against the naming conventions (DESIGN.md section 8) that services must follow.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "services/common/metrics/registry.h"
#include "tests/common/run_shell.h"

namespace nq::metrics {
namespace {

using ::nq::testing::CommandResult;
using ::nq::testing::RunShell;

// The absolute path of `program` on $PATH, or "" if it is not there.
std::string FindOnPath(const char* program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", program);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

void FillEveryFeature(Registry& registry) {
  // Unlabelled counter that was never incremented: must still expose `0`.
  registry.Counter("nq_prompt_tokens_total", "Prompt tokens processed.");
  registry.Counter("nq_generation_tokens_total", "Tokens generated.").Get().Increment(12345);
  // Help text with a backslash, quotes and a newline; label values needing every escape,
  // non-ASCII text, and bytes that are not UTF-8 (replaced, or promtool would reject them).
  auto& success =
      registry.Counter("nq_request_success_total",
                       "Requests finished, by reason.\nA \"reason\" with \\ in it is escaped.",
                       {"finished_reason", "model"});
  success.WithLabels({"stop", "llama"}).Increment();
  success.WithLabels({"a\\b\"c\nd", "größe-模型"}).Increment(2.5);
  success.WithLabels({"bad\xff\xfe utf8", ""}).Increment();
  // Labelled family without children: header lines only.
  registry.Counter("nq_expert_calls_total", "Expert calls, by bit width.", {"bits"});

  registry.Gauge("nq_num_requests_running", "Requests running.").Get().Set(3);
  auto& backlog =
      registry.Gauge("nq_streamer_read_backlog_bytes", "Bytes queued for reading.", {"rank"});
  backlog.WithLabels({"0"}).Set(1e21);
  backlog.WithLabels({"1"}).Set(-0.000125);
  backlog.WithLabels({"2"}).Set(std::numeric_limits<double>::infinity());
  backlog.WithLabels({"3"}).Set(-std::numeric_limits<double>::infinity());
  backlog.WithLabels({"4"}).Set(std::nan(""));

  auto& ttft = registry
                   .Histogram("nq_time_to_first_token_seconds", "Time to first token.",
                              ExponentialBuckets(0.001, 2, 15))
                   .Get();
  for (double v : {0.0005, 0.002, 0.1, 0.1, 3.0, 100.0}) ttft.Observe(v);
  auto& read_latency =
      registry.Histogram("nq_streamer_read_latency_seconds", "Read latency, by model.",
                         LinearBuckets(0.5, 0.5, 4), {"model"});
  read_latency.WithLabels({"llama"}).Observe(0.75);
  read_latency.WithLabels({"q\"uote"}).Observe(std::nan(""));
  // Histogram with labels but no children yet.
  registry.Histogram("nq_inter_token_latency_seconds", "Inter-token latency.", {0.01, 0.1},
                     {"model"});
}

TEST(PromtoolTest, CheckMetricsAcceptsEveryFeatureWithoutLintProblems) {
  const std::string promtool = FindOnPath("promtool");
  ASSERT_FALSE(promtool.empty())
      << "promtool is not on PATH; this test needs the real Prometheus checker. "
         "Run scripts/setup.sh, which installs it (Debian package `prometheus`).";

  Registry registry;
  FillEveryFeature(registry);
  const std::string exposition = registry.Serialize();

  const std::string path =
      absl::StrCat(::testing::TempDir(), "nq_metrics_promtool_", getpid(), ".prom");
  {
    std::ofstream file(path, std::ios::binary);
    ASSERT_TRUE(file) << "cannot write " << path;
    file << exposition;
  }
  const CommandResult result =
      RunShell(absl::StrCat("'", promtool, "' check metrics < '", path, "'"));
  std::remove(path.c_str());

  EXPECT_EQ(result.exit_code, 0) << "promtool output:\n"
                                 << result.output << "\nexposition:\n"
                                 << exposition;
  EXPECT_EQ(result.output, "") << "exposition:\n" << exposition;
}

// Guards the test above: promtool must actually be checking, so a lint problem fails.
TEST(PromtoolTest, CheckMetricsReportsLintProblems) {
  const std::string promtool = FindOnPath("promtool");
  ASSERT_FALSE(promtool.empty()) << "promtool is not on PATH; run scripts/setup.sh.";
  Registry registry;
  registry.Counter("nq_latency_milliseconds", "No _total suffix and not a base unit.");
  const std::string path =
      absl::StrCat(::testing::TempDir(), "nq_metrics_promtool_lint_", getpid(), ".prom");
  {
    std::ofstream file(path, std::ios::binary);
    file << registry.Serialize();
  }
  const CommandResult result =
      RunShell(absl::StrCat("'", promtool, "' check metrics < '", path, "'"));
  std::remove(path.c_str());
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("_total"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace nq::metrics
