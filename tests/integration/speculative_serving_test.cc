// MTP speculative decoding through the real binaries (router, worker, streamer on loopback,
// the embedded glm5_nano): a worker with drafts (the default, 3 per step) answers greedy
// requests exactly as a worker without, stop strings included; it reports the routing of the
// tokens it kept only; its /metrics carries the nq_spec_decode_* counters. A checkpoint
// whose MTP tensors were dropped serves without drafts, with one warning.
#include <signal.h>

#include <deque>
#include <filesystem>
#include <optional>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/common/checkpoint_copy.h"
#include "tests/common/embedded_model.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/raw_http.h"

namespace nq::testing {
namespace {

using Json = nlohmann::json;
using ::testing::HasSubstr;

// Distinct first tokens, so no request reuses another's KV and each one's routing count is
// known exactly: prompt + completion - 1 tokens run through the model.
const std::vector<std::string> kPrompts = {
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n"};

struct Cluster {
  ServicePorts streamer_ports, worker_ports, router_ports;
  std::optional<ChildProcess> streamer, worker, router;
};

class SpeculativeServingTest : public ClusterTest {
 protected:
  static void SetUpTestSuite() {
    ASSERT_NO_FATAL_FAILURE(nq::testing::PrepareEmbeddedModel(NQ_TOOL_BIN, NQ_SOURCE_DIR, NQ_EMBEDDED_MODEL_DIR));
  }
  void TearDown() override {
    for (Cluster& c : clusters_) {
      for (std::optional<ChildProcess>* child : {&c.router, &c.worker, &c.streamer}) {
        if (!child->has_value()) continue;
        (*child)->Signal(SIGTERM);
        absl::StatusOr<int> code = (*child)->WaitForExit(std::chrono::seconds(20));
        EXPECT_TRUE(code.ok() && *code == 0) << (*child)->Log();
      }
    }
    if (!temp_dir_.empty()) std::filesystem::remove_all(temp_dir_);
  }

  Cluster& Start(const std::string& model_dir, std::vector<std::string> worker_flags) {
    Cluster& c = clusters_.emplace_back();
    c.streamer_ports = NewPorts();
    c.worker_ports = NewPorts();
    c.router_ports = NewPorts();
    c.streamer.emplace(StartStreamer(c.streamer_ports));
    worker_flags.insert(worker_flags.end(),
                        {"--model=" + model_dir, "--served_model_name=embedded", "--max_model_len=512"});
    c.worker.emplace(StartWorker(c.worker_ports, c.streamer_ports.grpc, worker_flags));
    c.router.emplace(StartRouter(c.router_ports, c.worker_ports.grpc, {"--tokenizer=" + model_dir + "/tokenizer.json"}));
    EXPECT_TRUE(WaitServing(c.router_ports.grpc, std::chrono::seconds(60))) << c.router->Log() << c.worker->Log();
    return c;
  }

  static Json Complete(const Cluster& c, const Json& body) {
    absl::StatusOr<RawHttp> http = RawHttp::Post(c.router_ports.http, "/v1/completions", body.dump());
    EXPECT_TRUE(http.ok()) << http.status();
    if (!http.ok()) return Json();
    EXPECT_EQ(http->Status().value_or(0), 200);
    return Json::parse(http->Body().value_or(""), nullptr, false);
  }

  // A sample's value from `port`'s /metrics (`series` with its labels), or -1 when absent.
  static double Metric(int port, const std::string& series) {
    const std::string body = HttpGet(port, "/metrics").body;
    const size_t at = body.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::stod(body.substr(at + series.size() + 2));
  }

  std::deque<Cluster> clusters_;
  std::filesystem::path temp_dir_;
};

TEST_F(SpeculativeServingTest, GreedyAnswersAndStopStringsAreThoseOfAWorkerWithoutDrafts) {
  // The CPU backend's default is no drafts (slower there); the other worker asks for 3.
  Cluster& plain = Start(NQ_EMBEDDED_MODEL_DIR, {});
  EXPECT_THAT(plain.worker->Log(), HasSubstr("speculative decoding off on the cpu backend by default"));
  EXPECT_THAT(plain.worker->Log(), HasSubstr("speculative decoding: off"));
  Cluster& spec = Start(NQ_EMBEDDED_MODEL_DIR, {"--speculative_tokens=3"});
  EXPECT_THAT(spec.worker->Log(), HasSubstr("speculative decoding: 3 MTP draft tokens per step"));

  // Phase 1: full-length greedy completions, and the routing each worker reported.
  double expected_routing_tokens = 0;
  std::vector<std::string> texts;
  for (const std::string& prompt : kPrompts) {
    const Json request = {{"model", "embedded"}, {"prompt", prompt}, {"max_tokens", 40},
                          {"temperature", 0}, {"ignore_eos", true}};
    const Json a = Complete(plain, request);
    const Json b = Complete(spec, request);
    ASSERT_FALSE(a.is_discarded() || b.is_discarded());
    EXPECT_EQ(b["choices"][0]["text"], a["choices"][0]["text"]) << prompt;
    EXPECT_EQ(b["usage"], a["usage"]) << prompt;
    texts.push_back(a["choices"][0]["text"].get<std::string>());
    expected_routing_tokens +=
        a["usage"]["prompt_tokens"].get<double>() + a["usage"]["completion_tokens"].get<double>() - 1;
  }
  // Rejected drafts ran through the spec worker's layers too; its reports must not count them.
  for (const Cluster* c : {&plain, &spec}) {
    EXPECT_TRUE(WaitFor([&] { return Metric(c->streamer_ports.http, "nq_streamer_routing_tokens_total") >=
                                     expected_routing_tokens; },
                        std::chrono::seconds(5)));
    EXPECT_EQ(Metric(c->streamer_ports.http, "nq_streamer_routing_tokens_total"), expected_routing_tokens);
  }

  // The drafts were used, and counted.
  const int port = spec.worker_ports.http;
  const double drafts = Metric(port, "nq_spec_decode_num_drafts_total");
  const double draft_tokens = Metric(port, "nq_spec_decode_num_draft_tokens_total");
  const double accepted = Metric(port, "nq_spec_decode_num_accepted_tokens_total");
  const double pos0 = Metric(port, "nq_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}");
  const double pos1 = Metric(port, "nq_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"}");
  const double pos2 = Metric(port, "nq_spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"}");
  EXPECT_GT(drafts, 0);
  EXPECT_LE(draft_tokens, 3 * drafts);
  EXPECT_GT(draft_tokens, 2 * drafts) << "most steps verify all 3 drafts";
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, draft_tokens);
  EXPECT_EQ(pos0 + pos1 + pos2, accepted);
  EXPECT_GE(pos0, pos1);
  EXPECT_GE(pos1, pos2);
  // A verification step emits 1 + its accepted drafts, so the decode steps' tokens (each
  // completion's but the prefill's) are drafts + accepted, give or take one per request: its
  // last step may verify no draft (nothing left to draft for) or end on an accepted draft.
  const double decoded = static_cast<double>(kPrompts.size() * (40 - 1));
  EXPECT_NEAR(drafts + accepted, decoded, static_cast<double>(kPrompts.size()));
  EXPECT_EQ(Metric(plain.worker_ports.http, "nq_spec_decode_num_drafts_total"), -1) << "no drafts, no counters";
  // The drafting part of each step that drafted (every step but a request's last, which may
  // have nothing left to draft for), inside the steps' time.
  const double drafted_steps = Metric(port, "nq_worker_step_seconds_count{phase=\"draft\"}");
  EXPECT_GE(drafted_steps, drafts);
  EXPECT_LE(drafted_steps, Metric(port, "nq_worker_step_seconds_count{phase=\"decode\"}") +
                               Metric(port, "nq_worker_step_seconds_count{phase=\"prefill\"}"));
  EXPECT_GT(Metric(port, "nq_worker_step_seconds_sum{phase=\"draft\"}"), 0);
  EXPECT_LT(Metric(port, "nq_worker_step_seconds_sum{phase=\"draft\"}"),
            Metric(port, "nq_worker_step_seconds_sum{phase=\"decode\"}") +
                Metric(port, "nq_worker_step_seconds_sum{phase=\"prefill\"}"));
  EXPECT_EQ(Metric(plain.worker_ports.http, "nq_worker_step_seconds_count{phase=\"draft\"}"), -1);
  // The CPU backend runs no step graphs: each event's counter is exported, at zero.
  for (const char* event : {"warmup", "capture", "replay"}) {
    EXPECT_EQ(Metric(port, absl::StrCat("nq_worker_step_graphs_total{event=\"", event, "\"}")), 0) << event;
  }
  EXPECT_EQ(Metric(port, "nq_worker_step_graphs_off"), 0) << "no capture failed (none ran)";
  absl::StatusOr<std::string> checked = PromtoolCheck(HttpGet(port, "/metrics").body);
  EXPECT_TRUE(checked.ok()) << checked.status();

  // Phase 2: stop strings that end the text inside a multi-token step, streamed and not.
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string& text = texts[i];
    ASSERT_GT(text.size(), 20u);
    const std::string stop = text.substr(text.size() / 2, 3);
    Json request = {{"model", "embedded"}, {"prompt", kPrompts[i]}, {"max_tokens", 40},
                    {"temperature", 0}, {"stop", Json::array({stop})}, {"stream", i % 2 == 1}};
    if (i % 2 == 0) {
      const Json a = Complete(plain, request);
      const Json b = Complete(spec, request);
      EXPECT_EQ(b["choices"][0]["text"], a["choices"][0]["text"]) << "stop " << stop;
      EXPECT_EQ(b["choices"][0]["finish_reason"], a["choices"][0]["finish_reason"]);
      EXPECT_EQ(b["usage"]["completion_tokens"], a["usage"]["completion_tokens"]);
      EXPECT_EQ(a["choices"][0]["finish_reason"], "stop");
    } else {
      std::string streamed[2];
      for (int k = 0; k < 2; ++k) {
        absl::StatusOr<RawHttp> http =
            RawHttp::Post((k == 0 ? plain : spec).router_ports.http, "/v1/completions", request.dump());
        ASSERT_TRUE(http.ok());
        while (true) {
          absl::StatusOr<std::string> event = http->NextEvent();
          ASSERT_TRUE(event.ok()) << event.status();
          if (*event == "[DONE]") break;
          const Json chunk = Json::parse(*event, nullptr, false);
          for (const Json& choice : chunk.value("choices", Json::array())) streamed[k] += choice.value("text", "");
        }
      }
      EXPECT_EQ(streamed[1], streamed[0]) << "stop " << stop;
      EXPECT_EQ(streamed[0], text.substr(0, text.find(stop)));
    }
  }
}

TEST_F(SpeculativeServingTest, ACheckpointWithoutMtpTensorsServesWithoutDraftsAndOneWarning) {
  temp_dir_ = std::filesystem::temp_directory_path() / ("nq_no_mtp_" + std::to_string(::getpid()));
  // glm5_nano has 5 decoder layers; model.layers.5 is its MTP layer.
  ASSERT_TRUE(CopyCheckpointWithout(NQ_EMBEDDED_MODEL_DIR, temp_dir_.string(), [](const std::string& name) {
                return absl::StartsWith(name, "model.layers.5.");
              }).ok());
  Cluster& c = Start(temp_dir_.string(), {});
  const Json answer = Complete(c, {{"model", "embedded"}, {"prompt", kPrompts[0]}, {"max_tokens", 8},
                                   {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_EQ(answer["usage"]["completion_tokens"], 8);
  const std::string log = c.worker->Log();
  EXPECT_THAT(log, HasSubstr("no model.layers.5.* tensor"));
  EXPECT_THAT(log, HasSubstr("speculative decoding: off"));
  int warnings = 0;  // the log pattern puts the level letter before the logger's name
  for (size_t at = log.find(" W worker["); at != std::string::npos; at = log.find(" W worker[", at + 1)) ++warnings;
  EXPECT_EQ(warnings, 1) << log;
  EXPECT_EQ(Metric(c.worker_ports.http, "nq_spec_decode_num_drafts_total"), -1);

  // Asking for drafts by name on such a checkpoint is refused, with the reason.
  const ServicePorts ports = NewPorts();
  ChildProcess refused = StartWorker(ports, FreePort(), {"--model=" + temp_dir_.string(), "--speculative_tokens=2"});
  absl::StatusOr<int> code = refused.WaitForExit(std::chrono::seconds(30));
  ASSERT_TRUE(code.ok()) << refused.Log();
  EXPECT_NE(*code, 0);
  EXPECT_THAT(refused.Log(), HasSubstr("--speculative_tokens=2: config.json names 1 MTP layer(s)"));
}

}  // namespace
}  // namespace nq::testing
