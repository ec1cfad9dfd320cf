// The serving tests' fixture: the three real binaries on loopback with the embedded default
// model (a GlmMoeDsaForCausalLM trained on Python sources, models/glm5_nano, with its
// tokenizer), and the HTTP helpers the tests share (JSON posts, SSE streams, metrics).
#pragma once

#include <signal.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "tests/common/embedded_model.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/raw_http.h"

namespace nq::testing {

class ServingTest : public ClusterTest {
 public:
  using Json = nlohmann::json;

 protected:
  static void SetUpTestSuite() {
    // Shared by every test process (ctest runs each test alone): the script prepares it once,
    // under a lock, and later calls find it ready.
    model_dir_ = new std::string(NQ_EMBEDDED_MODEL_DIR);
    ASSERT_NO_FATAL_FAILURE(nq::testing::PrepareEmbeddedModel(NQ_TOOL_BIN, NQ_SOURCE_DIR, *model_dir_));
  }
  static void TearDownTestSuite() { delete model_dir_; }

  // Starts the three services; extra router flags in `router_flags`. `streamed`: the worker
  // serves the routed experts from the model's release and the streamer streams its records.
  // `worker_flags` are added to (and override) the worker's defaults.
  void StartCluster(std::vector<std::string> router_flags = {}, bool streamed = false,
                    std::vector<std::string> worker_extra = {}) {
    router_flags.push_back("--tokenizer=" + *model_dir_ + "/tokenizer.json");
    // NewPorts hands out ports free when asked; a test process running beside this one may
    // bind one before our service does. A service that says so is restarted on fresh ports;
    // any other failure to serve fails the test.
    for (int attempt = 1;; ++attempt) {
      StartClusterOnce(router_flags, streamed, worker_extra);
      if (WaitServing(router_ports_.grpc, std::chrono::seconds(60))) return;
      const std::string logs = streamer_->Log() + worker_->Log() + router_->Log();
      if (attempt == 3 || logs.find("the address is in use") == std::string::npos) {
        FAIL() << "the cluster did not serve:\n" << router_->Log() << worker_->Log();
      }
      for (std::optional<ChildProcess>* child : {&router_, &worker_, &streamer_}) {
        (*child)->Signal(SIGKILL);
        (void)(*child)->WaitForExit(std::chrono::seconds(10));
        child->reset();
      }
    }
  }

  void StartClusterOnce(const std::vector<std::string>& router_flags, bool streamed,
                        const std::vector<std::string>& worker_extra) {
    streamer_ports_ = NewPorts();
    worker_ports_ = NewPorts();
    router_ports_ = NewPorts();
    streamer_.emplace(StartStreamer(streamer_ports_, StreamerFlags(streamed)));
    std::vector<std::string> worker_flags = {"--model=" + *model_dir_, "--served_model_name=embedded",
                                             "--max_model_len=512"};
    if (streamed) {
      // The arena as a newcomer gets it: sized from the release (its 4 fixed experts per
      // layer, 8 floating, 1 staging), so the predictor has slots to fill.
      worker_flags.push_back("--verify_slots");
      worker_flags.push_back("--release=" + *model_dir_ + "/release");
    }
    worker_flags.insert(worker_flags.end(), worker_extra.begin(), worker_extra.end());
    worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc, worker_flags));
    router_.emplace(StartRouter(router_ports_, worker_ports_.grpc, router_flags));
  }

  // serving_test.cc: a streamed request survives a SIGKILLed streamer, whose restart adopts the
  // worker's READY slots (the worker started with `worker_extra`).
  void KillTheStreamerMidGeneration(const std::vector<std::string>& worker_extra);

  void TearDown() override {
    for (std::optional<ChildProcess>* child : {&router_, &worker_, &streamer_}) {
      if (!child->has_value()) continue;
      (*child)->Signal(SIGTERM);
      absl::StatusOr<int> code = (*child)->WaitForExit(std::chrono::seconds(20));
      EXPECT_TRUE(code.ok() && *code == 0) << (*child)->Log();
    }
  }

  absl::StatusOr<std::pair<int, Json>> PostJson(const std::string& path, const Json& body,
                                                const std::vector<std::string>& headers = {}) {
    absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, path, body.dump(), headers);
    if (!http.ok()) return http.status();
    absl::StatusOr<int> status = http->Status();
    if (!status.ok()) return status.status();
    absl::StatusOr<std::string> text = http->Body();
    if (!text.ok()) return text.status();
    Json json = Json::parse(*text, nullptr, false);
    return std::make_pair(*status, json);
  }

  // Streams a request; returns the concatenated text/content and the finish reason.
  struct Streamed {
    std::string text;
    std::string reasoning;  // chat: delta.reasoning_content
    std::string finish;
    Json usage;
    int events = 0;
    std::vector<Json> chunks;  // every event but [DONE], parsed
  };
  Streamed Stream(const std::string& path, Json body) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, path, body.dump());
    Streamed out;
    // A refused connection fails the test; dereferencing the error would abort the process
    // and leave the three services running without their TearDown.
    if (!http.ok()) {
      ADD_FAILURE() << "POST " << path << ": " << http.status();
      return out;
    }
    EXPECT_EQ(http->Status().value_or(0), 200);
    while (true) {
      absl::StatusOr<std::string> event = http->NextEvent();
      if (!event.ok()) {
        ADD_FAILURE() << "the stream ended without [DONE]: " << event.status();
        break;
      }
      if (*event == "[DONE]") break;
      Json chunk = Json::parse(*event, nullptr, false);
      EXPECT_FALSE(chunk.is_discarded()) << *event;
      ++out.events;
      out.chunks.push_back(chunk);
      if (chunk.contains("usage") && !chunk["usage"].is_null()) out.usage = chunk["usage"];
      for (const Json& choice : chunk.value("choices", Json::array())) {
        if (choice.contains("text")) out.text += choice["text"].get<std::string>();
        if (choice.contains("delta") && choice["delta"].contains("content")) {
          out.text += choice["delta"]["content"].get<std::string>();
        }
        if (choice.contains("delta") && choice["delta"].contains("reasoning_content")) {
          out.reasoning += choice["delta"]["reasoning_content"].get<std::string>();
        }
        if (choice.contains("finish_reason") && !choice["finish_reason"].is_null()) {
          out.finish = choice["finish_reason"].get<std::string>();
        }
      }
    }
    return out;
  }

  double Metric(int port, const std::string& name) {
    const std::string body = HttpGet(port, "/metrics").body;
    const size_t at = body.find("\n" + name + " ");
    if (at == std::string::npos) return -1;
    return std::stod(body.substr(at + name.size() + 2));
  }

  std::vector<std::string> StreamerFlags(bool streamed) {
    if (!streamed) return {};
    std::vector<std::string> flags = {"--records_dir=" + *model_dir_ + "/release", "--read_budget=8"};
    flags.insert(flags.end(), streamer_extra_.begin(), streamer_extra_.end());
    return flags;
  }
  // Added to the streamer's flags of a streamed cluster (set before StartCluster).
  std::vector<std::string> streamer_extra_;

  static std::string* model_dir_;
  ServicePorts streamer_ports_, worker_ports_, router_ports_;
  std::optional<ChildProcess> streamer_, worker_, router_;
};

}  // namespace nq::testing
