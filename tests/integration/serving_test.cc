// End to end through router, worker and streamer with the embedded default model (a
// GlmMoeDsaForCausalLM trained on Python sources, models/glm5_nano, with its tokenizer): the OpenAI
// API, SSE, gRPC, the queue, disconnects and every client error.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "nq/v1/inference.grpc.pb.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using Json = nlohmann::json;
using ::testing::AnyOf;
using ::testing::HasSubstr;

TEST_F(ServingTest, CompletionsAreSeededAndReportUsage) {
  StartCluster();
  const Json request = {{"model", "embedded"}, {"prompt", "The quick brown fox"}, {"max_tokens", 12},
                        {"temperature", 0.9}, {"seed", 1234}, {"ignore_eos", true}};
  absl::StatusOr<std::pair<int, Json>> first = PostJson("/v1/completions", request);
  absl::StatusOr<std::pair<int, Json>> second = PostJson("/v1/completions", request);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_EQ(first->first, 200) << first->second.dump();
  const Json& body = first->second;
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["model"], "embedded");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 12);
  EXPECT_GT(body["usage"]["prompt_tokens"].get<int>(), 3);
  EXPECT_EQ(body["choices"][0]["text"], second->second["choices"][0]["text"]) << "same seed, same text";

  // The stream carries the same text, a finish reason and usage.
  Streamed streamed = Stream("/v1/completions", request);
  EXPECT_EQ(streamed.text, body["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(streamed.finish, "length");
  EXPECT_EQ(streamed.usage["completion_tokens"], 12);
  EXPECT_GT(Metric(router_ports_.http, "nq_generation_tokens_total"), 35);
  // The worker reported the routing of every token it ran to the streamer (asynchronously):
  // three requests of 12 tokens, 11 of them decoded, plus at least the last prompt token each.
  EXPECT_TRUE(WaitFor([&] { return Metric(streamer_ports_.http, "nq_streamer_routing_tokens_total") >= 36; },
                      std::chrono::seconds(5)))
      << Metric(streamer_ports_.http, "nq_streamer_routing_tokens_total");
  EXPECT_GE(Metric(worker_ports_.http, "nq_worker_routing_reports_sent_total"), 3);
}

TEST_F(ServingTest, ChatCompletionStreamsAndStops) {
  StartCluster();
  Json request = {{"model", "embedded"},
                  {"messages", Json::array({{{"role", "system"}, {"content", "Be brief."}},
                                            {{"role", "user"}, {"content", "Say hello in Korean: 안녕"}}})},
                  {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}};
  absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/chat/completions", request);
  ASSERT_TRUE(reply.ok());
  ASSERT_EQ(reply->first, 200) << reply->second.dump();
  EXPECT_EQ(reply->second["object"], "chat.completion");
  const Json& message = reply->second["choices"][0]["message"];
  EXPECT_EQ(message["role"], "assistant");
  const std::string content = message["content"].is_string() ? message["content"].get<std::string>() : "";
  const std::string reasoning = message.value("reasoning_content", std::string());
  // Greedy: the stream says exactly what the single answer said, in the same fields.
  Streamed streamed = Stream("/v1/chat/completions", request);
  EXPECT_EQ(streamed.text, content);
  EXPECT_EQ(streamed.reasoning, reasoning);
  EXPECT_EQ(streamed.finish, "length");
  EXPECT_GT(streamed.events, 1);

  // A stop string taken from the middle of the answer: both forms end just before it. (The
  // GLM-5 template leaves this model's output in reasoning_content; see the README test.)
  const std::string& said = reasoning.empty() ? content : reasoning;
  constexpr size_t kStopLength = 3;
  size_t at = said.size() / 2;
  auto usable = [&](size_t p) {
    const std::string stop = said.substr(p, kStopLength);
    return stop.size() == kStopLength && said.find(stop) == p && stop.find_first_of("<>") == std::string::npos &&
           std::all_of(stop.begin(), stop.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }) &&
           std::string("<think></think>\n").find(stop) == std::string::npos;
  };
  while (at < said.size() && !usable(at)) ++at;
  ASSERT_LT(at, said.size()) << "no usable stop string in: " << said;
  request["stop"] = said.substr(at, kStopLength);
  const std::string expected = said.substr(0, at);
  absl::StatusOr<std::pair<int, Json>> stopped = PostJson("/v1/chat/completions", request);
  ASSERT_TRUE(stopped.ok());
  ASSERT_EQ(stopped->first, 200) << stopped->second.dump();
  const Json& stopped_message = stopped->second["choices"][0]["message"];
  EXPECT_EQ(stopped->second["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(reasoning.empty() ? stopped_message["content"] : stopped_message["reasoning_content"], expected)
      << "stop " << request["stop"] << " in " << said;
  Streamed streamed_stop = Stream("/v1/chat/completions", request);
  EXPECT_EQ(streamed_stop.finish, "stop");
  EXPECT_EQ(reasoning.empty() ? streamed_stop.text : streamed_stop.reasoning, expected);
}

// The README's first chat request, as scripts/up.sh serves it (--chat_format=plain for the
// embedded model, which never saw chat markup): the answer is text in `content`. Under the
// GLM-5 template the same model opens a <think> block it never closes, and everything it
// says lands in reasoning_content (what a real GLM-5 checkpoint still gets).
TEST_F(ServingTest, TheReadmeChatExampleAnswersInContentWithThePlainFormat) {
  StartCluster({"--chat_format=plain"});
  const Json request = {{"model", "embedded"},
                        {"messages", Json::array({{{"role", "user"}, {"content", "def fibonacci(n):"}}})},
                        {"max_tokens", 16}, {"temperature", 0}, {"ignore_eos", true}};
  absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/chat/completions", request);
  ASSERT_TRUE(reply.ok());
  ASSERT_EQ(reply->first, 200) << reply->second.dump();
  const Json& message = reply->second["choices"][0]["message"];
  ASSERT_TRUE(message["content"].is_string()) << message.dump();
  EXPECT_FALSE(message["content"].get<std::string>().empty()) << message.dump();
  EXPECT_TRUE(!message.contains("reasoning_content") || message["reasoning_content"].is_null() ||
              message["reasoning_content"] == "")
      << message.dump();
  // The prompt is the user's text and a newline: no roles, no special tokens.
  absl::StatusOr<std::pair<int, Json>> plain =
      PostJson("/tokenize", {{"prompt", "def fibonacci(n):\n"}, {"add_special_tokens", false}});
  ASSERT_TRUE(plain.ok());
  absl::StatusOr<std::pair<int, Json>> rendered = PostJson("/tokenize", {{"messages", request["messages"]}});
  ASSERT_TRUE(rendered.ok());
  EXPECT_EQ(rendered->second["tokens"], plain->second["tokens"]) << rendered->second.dump();
  EXPECT_EQ(reply->second["usage"]["prompt_tokens"], plain->second["count"]);
  Streamed streamed = Stream("/v1/chat/completions", request);
  EXPECT_EQ(streamed.text, message["content"].get<std::string>());
  // Plain text cannot carry tools: refused by name, not ignored.
  Json with_tools = request;
  with_tools["tools"] = Json::array({{{"type", "function"}, {"function", {{"name", "get_weather"}}}}});
  absl::StatusOr<std::pair<int, Json>> refused = PostJson("/v1/chat/completions", with_tools);
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->first, 400) << refused->second.dump();
  EXPECT_THAT(refused->second.dump(), HasSubstr("no tools"));
}

TEST_F(ServingTest, GrpcGenerateStreams) {
  StartCluster();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_ports_.grpc), grpc::InsecureChannelCredentials());
  auto stub = nq::v1::Inference::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  nq::v1::GenerateRequest request;
  request.set_prompt("Once upon a time");
  request.mutable_sampling()->set_max_tokens(6);
  request.mutable_sampling()->set_ignore_eos(true);
  request.set_return_tokens(true);
  auto reader = stub->Generate(&context, request);
  nq::v1::GenerateResponse response;
  int tokens = 0;
  nq::v1::FinishReason finish = nq::v1::FINISH_REASON_UNSPECIFIED;
  while (reader->Read(&response)) {
    tokens += response.tokens_size();
    if (response.finish_reason() != nq::v1::FINISH_REASON_UNSPECIFIED) finish = response.finish_reason();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 6);
  EXPECT_EQ(finish, nq::v1::FINISH_REASON_LENGTH);
}

TEST_F(ServingTest, ClientErrorsGetPreciseStatusesAndTheServerStaysUp) {
  StartCluster({"--api_key=s3cret", "--max_body_bytes=65536", "--max_tokens_limit=100"});
  const std::vector<std::string> auth = {"Authorization: Bearer s3cret"};
  struct Case {
    std::string body;
    std::vector<std::string> headers;
    int status;
    std::string type;
    std::string message;  // a part of error.message
  };
  const std::vector<Case> cases = {
      {R"({"model":"embedded","prompt":"hi"})", {}, 401, "authentication_error", "API key"},
      {R"({"model":"embedded","prompt":"hi"})", {"Authorization: Bearer wrong"}, 401, "authentication_error", "API key"},
      {R"({"model":"embedded","prompt":)", auth, 400, "invalid_request_error", ""},
      {R"({"model":"embedded","prompt":"hi","max_tokens":"ten"})", auth, 400, "invalid_request_error", "max_tokens"},
      {R"({"model":"embedded","prompt":"hi","temperature":7})", auth, 400, "invalid_request_error", "temperature"},
      {R"({"model":"embedded","prompt":"hi","max_tokens":1000})", auth, 400, "invalid_request_error", "max_tokens"},
      // The route's own 404, not the router's "no route" (httplib calls the error handler after it).
      {R"({"model":"gpt-17","prompt":"hi"})", auth, 404, "invalid_request_error",
       "the model 'gpt-17' does not exist; this server serves 'embedded'"},
      {absl::StrCat(R"({"model":"embedded","prompt":")", std::string(100000, 'a'), R"("})"), auth, 413,
       "invalid_request_error", "too large"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, "/v1/completions", c.body, c.headers);
    ASSERT_TRUE(http.ok());
    EXPECT_EQ(http->Status().value_or(0), c.status) << c.body.substr(0, 80);
    Json error = Json::parse(http->Body().value_or(""), nullptr, false);
    EXPECT_EQ(error["error"]["type"], c.type) << c.body.substr(0, 80) << " -> " << error.dump();
    EXPECT_THAT(error["error"]["message"].is_string() ? error["error"]["message"].get<std::string>() : "",
                ::testing::HasSubstr(c.message))
        << c.body.substr(0, 80);
  }
  absl::StatusOr<RawHttp> no_route = RawHttp::Post(router_ports_.http, "/v1/nowhere", "{}", auth);
  ASSERT_TRUE(no_route.ok());
  EXPECT_EQ(no_route->Status().value_or(0), 404);
  EXPECT_THAT(no_route->Body().value_or(""), ::testing::HasSubstr("no route for POST /v1/nowhere"));
  absl::StatusOr<std::pair<int, Json>> ok =
      PostJson("/v1/completions", {{"model", "embedded"}, {"prompt", "hi"}, {"max_tokens", 2}}, auth);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->first, 200);
  EXPECT_EQ(HttpGet(router_ports_.http, "/health").status, 200);
}

// Issue #22: with --api_key set, every route that generates or tells about the model needs
// the key, over HTTP and gRPC; a missing key, a wrong one and a prefix of the right one are
// all refused; /health, /metrics and gRPC health stay open.
TEST_F(ServingTest, ApiKeyGuardsEveryGenerationRouteButHealthAndMetrics) {
  StartCluster({"--api_key=s3cret"});
  struct Key {
    std::string name;
    std::vector<std::string> headers;  // HTTP
    std::string metadata;              // gRPC 'authorization', empty: none
    bool accepted;
  };
  const std::vector<Key> keys = {
      {"no key", {}, "", false},
      {"wrong key", {"Authorization: Bearer wrong"}, "Bearer wrong", false},
      {"prefix of the key", {"Authorization: Bearer s3cre"}, "Bearer s3cre", false},
      {"key plus a suffix", {"Authorization: Bearer s3cret2"}, "Bearer s3cret2", false},
      {"key without Bearer", {"Authorization: s3cret"}, "s3cret", false},
      {"right key", {"Authorization: Bearer s3cret"}, "Bearer s3cret", true},
  };
  const Json completion = {{"model", "embedded"}, {"prompt", "hi"}, {"max_tokens", 2}, {"ignore_eos", true}};
  const Json chat = {{"model", "embedded"},
                     {"messages", Json::array({{{"role", "user"}, {"content", "hi"}}})},
                     {"max_tokens", 2},
                     {"ignore_eos", true}};
  auto streaming = [](Json body) {
    body["stream"] = true;
    return body;
  };
  struct Route {
    std::string method, path;
    Json body;
  };
  const std::vector<Route> routes = {
      {"POST", "/v1/completions", completion},
      {"POST", "/v1/completions", streaming(completion)},
      {"POST", "/v1/chat/completions", chat},
      {"POST", "/v1/chat/completions", streaming(chat)},
      {"GET", "/v1/models", nullptr},
      {"POST", "/tokenize", {{"prompt", "hi"}}},
      {"POST", "/detokenize", {{"tokens", Json::array({1, 2})}}},
  };
  for (const Key& key : keys) {
    for (const Route& route : routes) {
      const std::string what = absl::StrCat(key.name, ": ", route.method, " ", route.path, " ", route.body.dump());
      absl::StatusOr<RawHttp> http = route.method == "GET"
                                         ? RawHttp::Get(router_ports_.http, route.path, key.headers)
                                         : RawHttp::Post(router_ports_.http, route.path, route.body.dump(), key.headers);
      ASSERT_TRUE(http.ok()) << what;
      const int status = http->Status().value_or(0);
      const std::string body = http->Body().value_or("");
      if (key.accepted) {
        EXPECT_EQ(status, 200) << what << " -> " << body;
        if (route.body.is_object() && route.body.value("stream", false)) {
          EXPECT_THAT(body, HasSubstr("[DONE]")) << what;
        }
      } else {
        EXPECT_EQ(status, 401) << what << " -> " << body;
        EXPECT_EQ(Json::parse(body, nullptr, false)["error"]["type"], "authentication_error") << what;
        EXPECT_THAT(body, ::testing::Not(HasSubstr("s3cret"))) << what;
      }
    }

    auto stub = nq::v1::Inference::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_ports_.grpc), grpc::InsecureChannelCredentials()));
    auto context = [&] {
      auto c = std::make_unique<grpc::ClientContext>();
      c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      if (!key.metadata.empty()) c->AddMetadata("authorization", key.metadata);
      return c;
    };
    const grpc::StatusCode want = key.accepted ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED;
    {
      nq::v1::GenerateRequest request;
      request.set_prompt("hi");
      request.mutable_sampling()->set_max_tokens(2);
      request.mutable_sampling()->set_ignore_eos(true);
      auto c = context();
      auto reader = stub->Generate(c.get(), request);
      nq::v1::GenerateResponse response;
      int tokens = 0;
      while (reader->Read(&response)) tokens += response.tokens_size();
      EXPECT_EQ(reader->Finish().error_code(), want) << key.name << ": Generate";
      if (!key.accepted) {
        EXPECT_EQ(tokens, 0) << key.name;
      }
    }
    {
      nq::v1::TokenizeRequest request;
      request.set_text("hi");
      nq::v1::TokenizeResponse response;
      auto c = context();
      EXPECT_EQ(stub->Tokenize(c.get(), request, &response).error_code(), want) << key.name << ": Tokenize";
    }
    {
      nq::v1::GetModelInfoRequest request;
      nq::v1::ModelInfo response;
      auto c = context();
      EXPECT_EQ(stub->GetModelInfo(c.get(), request, &response).error_code(), want) << key.name << ": GetModelInfo";
    }
  }
  // Open without a key: health (HTTP and gRPC) and metrics.
  EXPECT_EQ(HttpGet(router_ports_.http, "/health").status, 200);
  EXPECT_EQ(HttpGet(router_ports_.http, "/metrics").status, 200);
  EXPECT_EQ(GrpcHealth(router_ports_.grpc), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ServingTest, FullQueueRefusesWith429AndNoRequestHangs) {
  StartCluster({"--max_waiting=4"});
  const Json request = {{"model", "embedded"}, {"prompt", "count"}, {"max_tokens", 40}, {"ignore_eos", true}};
  std::vector<std::thread> clients;
  std::atomic<int> served{0}, refused{0}, other{0};
  for (int i = 0; i < 16; ++i) {
    clients.emplace_back([&] {
      absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/completions", request);
      if (!reply.ok()) {
        ++other;
      } else if (reply->first == 200) {
        ++served;
      } else if (reply->first == 429 && reply->second["error"]["type"] == "rate_limit_error") {
        ++refused;
      } else {
        ++other;
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(served + refused, 16);
  EXPECT_GE(served.load(), 5) << "one running and four waiting are always served";
  EXPECT_GE(refused.load(), 1);
  EXPECT_EQ(Metric(router_ports_.http, "nq_num_requests_waiting"), 0);
}

TEST_F(ServingTest, DisconnectMidStreamFreesTheWorkerWithinOneSecond) {
  StartCluster();
  Json long_request = {{"model", "embedded"}, {"prompt", "go"}, {"max_tokens", 400}, {"ignore_eos", true},
                       {"stream", true}};
  absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, "/v1/completions", long_request.dump());
  ASSERT_TRUE(http.ok());
  ASSERT_TRUE(http->NextEvent().ok());
  http->Close();
  const auto closed = std::chrono::steady_clock::now();
  // The next request starts (and finishes) promptly.
  absl::StatusOr<std::pair<int, Json>> next =
      PostJson("/v1/completions", {{"model", "embedded"}, {"prompt", "next"}, {"max_tokens", 1}});
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->first, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - closed, std::chrono::seconds(1));
  EXPECT_GE(Metric(router_ports_.http, "nq_request_success_total{finished_reason=\"abort\"}"), 1);
}

// A 400-token generation takes seconds on the embedded model (about 43 tokens/s on 2 cores):
// long enough that a request waiting behind it would be seen to wait.
Json LongCompletion(bool stream, int max_tokens = 400) {
  return {{"model", "embedded"}, {"prompt", "go"}, {"max_tokens", max_tokens}, {"ignore_eos", true}, {"stream", stream}};
}

TEST_F(ServingTest, NonStreamingClientThatHangsUpAbortsItsSequence) {
  StartCluster();
  absl::StatusOr<RawHttp> abandoned = RawHttp::Post(router_ports_.http, "/v1/completions", LongCompletion(false).dump());
  ASSERT_TRUE(abandoned.ok());
  ASSERT_TRUE(WaitFor([&] { return Metric(router_ports_.http, "nq_num_requests_running") == 1; },
                      std::chrono::seconds(10)));
  abandoned->Close();
  const auto closed = std::chrono::steady_clock::now();
  // The next request does not wait for the abandoned one's 400 tokens.
  absl::StatusOr<std::pair<int, Json>> next =
      PostJson("/v1/completions", {{"model", "embedded"}, {"prompt", "next"}, {"max_tokens", 1}});
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->first, 200) << next->second;
  EXPECT_LT(std::chrono::steady_clock::now() - closed, std::chrono::seconds(1));
  EXPECT_EQ(Metric(router_ports_.http, "nq_request_success_total{finished_reason=\"abort\"}"), 1);
  EXPECT_EQ(Metric(router_ports_.http, "nq_request_success_total{finished_reason=\"length\"}"), 1)
      << "only the 1-token request ran to its length";
}

TEST_F(ServingTest, QueuedClientThatHangsUpLosesItsPlaceAtOnce) {
  StartCluster();
  absl::StatusOr<RawHttp> running = RawHttp::Post(router_ports_.http, "/v1/completions", LongCompletion(false).dump());
  ASSERT_TRUE(running.ok());
  ASSERT_TRUE(WaitFor([&] { return Metric(router_ports_.http, "nq_num_requests_running") == 1; },
                      std::chrono::seconds(10)));
  for (bool stream : {false, true}) {
    absl::StatusOr<RawHttp> queued = RawHttp::Post(router_ports_.http, "/v1/completions", LongCompletion(stream).dump());
    ASSERT_TRUE(queued.ok());
    ASSERT_TRUE(WaitFor([&] { return Metric(router_ports_.http, "nq_num_requests_waiting") == 1; },
                        std::chrono::seconds(5)));
    queued->Close();
    // Dropped within the scheduler's poll, not at --request_timeout_s (600 s) nor when the
    // running request ends (seconds from now).
    EXPECT_TRUE(WaitFor([&] { return Metric(router_ports_.http, "nq_num_requests_waiting") == 0; },
                        std::chrono::milliseconds(500)))
        << "stream=" << stream;
    EXPECT_EQ(Metric(router_ports_.http, "nq_num_requests_running"), 1) << "the running request is untouched";
  }
  absl::StatusOr<int> status = running->Status();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(*status, 200);
  // Neither queued request ran after the first finished.
  EXPECT_EQ(Metric(router_ports_.http, "nq_request_success_total{finished_reason=\"length\"}"), 1);
  EXPECT_TRUE(WaitFor([&] { return Metric(router_ports_.http, "nq_num_requests_running") == 0; },
                      std::chrono::seconds(1)));
}

TEST_F(ServingTest, DrainTimeoutEndsRunningAndQueuedHttpRequestsAndTheRouterExitsByIt) {
  // A generation that outlasts the 2 s drain by far on any machine: 4000 tokens (the CPU
  // backend runs about 280 a second on two cores), in a context window that holds them.
  StartCluster({"--drain_timeout_s=2"}, /*streamed=*/false, {"--max_model_len=4096"});
  absl::StatusOr<RawHttp> running =
      RawHttp::Post(router_ports_.http, "/v1/completions", LongCompletion(true, 4000).dump());
  ASSERT_TRUE(running.ok());
  ASSERT_EQ(running->Status().value_or(0), 200);
  ASSERT_TRUE(running->NextEvent().ok());
  absl::StatusOr<RawHttp> queued =
      RawHttp::Post(router_ports_.http, "/v1/completions", LongCompletion(false, 4000).dump());
  ASSERT_TRUE(queued.ok());
  ASSERT_TRUE(WaitFor([&] { return Metric(router_ports_.http, "nq_num_requests_waiting") == 1; },
                      std::chrono::seconds(5)));

  const auto signalled = std::chrono::steady_clock::now();
  router_->Signal(SIGTERM);
  absl::StatusOr<int> code = router_->WaitForExit(std::chrono::seconds(10));
  const auto exited = std::chrono::steady_clock::now();
  ASSERT_TRUE(code.ok()) << code.status() << router_->Log();
  EXPECT_EQ(*code, 0) << router_->Log();
  EXPECT_GE(exited - signalled, std::chrono::milliseconds(1900)) << "the drain waits for running requests";
  EXPECT_LT(exited - signalled, std::chrono::seconds(3)) << router_->Log();
  router_.reset();

  // The stream ends with an error event that says why, then [DONE].
  std::string last_data;
  for (absl::StatusOr<std::string> event = running->NextEvent(); event.ok() && *event != "[DONE]";
       event = running->NextEvent()) {
    last_data = *event;
  }
  Json error = Json::parse(last_data, nullptr, false);
  ASSERT_TRUE(error.is_object() && error.contains("error")) << last_data;
  EXPECT_EQ(error["error"]["type"], "service_unavailable_error");
  EXPECT_THAT(error["error"]["message"].get<std::string>(), HasSubstr("drain deadline"));
  // The queued request never started: a plain 503 with the same reason.
  EXPECT_EQ(queued->Status().value_or(0), 503);
  absl::StatusOr<std::string> body = queued->Body();
  ASSERT_TRUE(body.ok());
  EXPECT_THAT(*body, HasSubstr("drain deadline"));
}

TEST_F(ServingTest, LogitBiasReachesTheWorkersSampler) {
  StartCluster();
  absl::StatusOr<std::pair<int, Json>> tokens =
      PostJson("/tokenize", {{"prompt", "hello"}, {"add_special_tokens", false}});
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->first, 200) << tokens->second;
  const int32_t id = tokens->second["tokens"][0].get<int32_t>();
  // +100 makes the token win every greedy step, whatever the model prefers.
  const Json request = {{"model", "embedded"}, {"prompt", "def"}, {"max_tokens", 4}, {"temperature", 0},
                        {"ignore_eos", true}, {"logit_bias", {{std::to_string(id), 100}}}};
  absl::StatusOr<std::pair<int, Json>> forced = PostJson("/v1/completions", request);
  ASSERT_TRUE(forced.ok());
  ASSERT_EQ(forced->first, 200) << forced->second;
  absl::StatusOr<std::pair<int, Json>> expected =
      PostJson("/detokenize", {{"tokens", std::vector<int32_t>(4, id)}});
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(forced->second["choices"][0]["text"], expected->second["prompt"]);
  EXPECT_EQ(forced->second["usage"]["completion_tokens"], 4);

  Json outside = request;
  outside["logit_bias"] = {{"9999999", 1}};
  absl::StatusOr<std::pair<int, Json>> refused = PostJson("/v1/completions", outside);
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->first, 400);
  EXPECT_THAT(refused->second["error"]["message"].get<std::string>(),
              HasSubstr("logit_bias token id 9999999 is outside the vocabulary"));
}

// The text the raw bytes `bytes` become: each maximal ill-formed subsequence replaced by one
// U+FFFD (Unicode's "maximal subpart" practice, section 3.9), written here from the standard
// so the router's detokenizer is checked against an independent decoder. Counts the
// replacements in `invalid`.
std::string SanitizeUtf8ForTest(const std::string& bytes, int* invalid) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char b = static_cast<unsigned char>(bytes[i]);
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the valid range of the second byte
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 2;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 3;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    }
    size_t j = i + 1;
    int got = 0;
    while (need > 0 && got < need && j < bytes.size()) {
      const unsigned char c = static_cast<unsigned char>(bytes[j]);
      if (got == 0 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
      ++got;
      ++j;
    }
    if (need > 0 && got == need) {
      out.append(bytes, i, j - i);
    } else {
      out += "\xEF\xBF\xBD";
      ++*invalid;
    }
    i = j;
  }
  return out;
}

// The special tokens' texts (the detokenizer skips them), from the model's tokenizer.json.
std::set<std::string> SpecialTokenTexts(const std::string& model_dir) {
  std::ifstream in(model_dir + "/tokenizer.json");
  const Json tokenizer = Json::parse(in, nullptr, false);
  std::set<std::string> out;
  for (const Json& added : tokenizer.value("added_tokens", Json::array())) {
    if (added.value("special", false)) out.insert(added.value("content", std::string()));
  }
  return out;
}

// The stream's text is the generated bytes, token by token (from the logprobs entries, which
// carry every token's exact bytes), decoded by an independent UTF-8 decoder: whole characters,
// a U+FFFD exactly where the model's bytes are ill-formed, and the router's counter agrees.
TEST_F(ServingTest, MultilingualStreamHasNoReplacementCharUnlessTheModelMadeInvalidBytes) {
  StartCluster({"--chat_format=plain"});
  const Json request = {{"model", "embedded"},
                        {"messages", Json::array({{{"role", "user"},
                                                   {"content", "한국어 日本語 中文 தமிழ் हिन्दी العربية русский 👩‍👩‍👧"}}})},
                        {"max_tokens", 64}, {"ignore_eos", true}, {"seed", 7}, {"temperature", 1.0}, {"logprobs", true}};
  Streamed streamed = Stream("/v1/chat/completions", request);
  const std::set<std::string> specials = SpecialTokenTexts(*model_dir_);
  std::string raw;
  int tokens = 0;
  for (const Json& chunk : streamed.chunks) {
    for (const Json& choice : chunk.value("choices", Json::array())) {
      if (!choice.contains("logprobs") || choice["logprobs"].is_null()) continue;
      for (const Json& entry : choice["logprobs"]["content"]) {
        ++tokens;
        std::string bytes;
        for (const Json& b : entry["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
        if (specials.count(bytes) == 0) raw += bytes;
      }
    }
  }
  ASSERT_EQ(tokens, 64);
  int invalid = 0;
  EXPECT_EQ(streamed.text, SanitizeUtf8ForTest(raw, &invalid));
  EXPECT_EQ(Metric(router_ports_.http, "nq_detokenize_invalid_utf8_total"), invalid);
}

TEST(SanitizeUtf8ForTest, ReplacesMaximalSubpartsOnce) {
  int invalid = 0;
  // Valid 2-, 3- and 4-byte characters pass; a truncated 3-byte sequence is one U+FFFD; a lone
  // continuation byte, an overlong lead (C0) and a surrogate lead's bad second byte are one each.
  EXPECT_EQ(SanitizeUtf8ForTest("a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80", &invalid), "a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80");
  EXPECT_EQ(invalid, 0);
  EXPECT_EQ(SanitizeUtf8ForTest("\xE4\xB8x", &invalid), "\xEF\xBF\xBDx");
  EXPECT_EQ(invalid, 1);
  EXPECT_EQ(SanitizeUtf8ForTest("\x80\xC0\xAF\xED\xA0\x80", &invalid),
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(invalid, 7);
}

TEST_F(ServingTest, StreamedExpertsRunAtFourBitsOnceTheirSlotsAreReady) {
  StartCluster({}, /*streamed=*/true);
  // The fixed sets (4 experts x the 4 decode MoE layers; the MTP layer gets no slots) load
  // when the session opens, and the default arena leaves the predictor 8 floating slots.
  constexpr double kFixedLoads = 16;
  ASSERT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_slots_ready") >= kFixedLoads; },
                      std::chrono::seconds(20)))
      << streamer_->Log();
  EXPECT_THAT(worker_->Log(), HasSubstr("4 MoE layers (MTP layers get none) x 13 slots: 4 fixed, 8 floating"));
  EXPECT_THAT(streamer_->Log(), HasSubstr("16 fixed-set loads queued, 8 floating slots per layer"));
  const Json request = {{"model", "embedded"}, {"prompt", "The quick brown fox"}, {"max_tokens", 48},
                        {"temperature", 0}, {"ignore_eos", true}};
  Streamed streamed = Stream("/v1/completions", request);
  EXPECT_EQ(streamed.finish, "length");
  EXPECT_GT(Metric(worker_ports_.http, "nq_expert_calls_total{bits=\"4\"}"), 0);
  EXPECT_GT(Metric(worker_ports_.http, "nq_expert_calls_total{bits=\"2\"}"), 0);
  // Beyond the fixed sets: the predictor placed experts in floating slots.
  EXPECT_TRUE(WaitFor(
      [&] { return Metric(streamer_ports_.http, "nq_streamer_slot_loads_total{result=\"ready\"}") > kFixedLoads; },
      std::chrono::seconds(10)))
      << streamer_->Log();
  EXPECT_GT(Metric(streamer_ports_.http, "nq_streamer_read_bytes_total"), 0);
  EXPECT_GT(Metric(streamer_ports_.http, "nq_streamer_predictor_refresh_seconds_count"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_updates_rejected_total"), 0);
  for (int port : {worker_ports_.http, streamer_ports_.http}) {
    absl::StatusOr<std::string> checked = PromtoolCheck(HttpGet(port, "/metrics").body);
    EXPECT_TRUE(checked.ok()) << checked.status();
  }
  // Greedy output does depend on the slots (an expert runs at 4 bits exactly while its
  // residual is READY), so the same request again is only required to stream well-formed to
  // its length; the text may differ.
  EXPECT_EQ(Stream("/v1/completions", request).finish, "length");
}

// An explicit arena that leaves no floating slot would quietly turn streaming into "the
// fixed set at 4 bits, nothing else": the worker refuses to start and says what to do.
TEST_F(ServingTest, AWorkerArenaWithoutAFloatingSlotIsRefused) {
  streamer_ports_ = NewPorts();
  worker_ports_ = NewPorts();
  streamer_.emplace(StartStreamer(streamer_ports_, StreamerFlags(true)));
  ChildProcess worker = StartWorker(worker_ports_, streamer_ports_.grpc,
                                    {"--model=" + *model_dir_, "--release=" + *model_dir_ + "/release",
                                     "--slots_per_layer=4"});
  absl::StatusOr<int> code = worker.WaitForExit(std::chrono::seconds(60));
  ASSERT_TRUE(code.ok()) << "the worker kept running:\n" << worker.Log();
  EXPECT_EQ(*code, 1) << worker.Log();
  EXPECT_THAT(worker.Log(), HasSubstr("--slots_per_layer=4 with 4 fixed slots per layer leaves no floating slot"));
  EXPECT_THAT(worker.Log(), HasSubstr("--expert_bits=fixed"));
}

// The slot mailbox (DESIGN.md section 4) on the CPU backend: the streamer posts the fixed sets and
// the predictor's loads there, every MoE block of every forward applies them, the worker's books
// follow, nothing is refused and every READY slot checks against its record (--verify_slots).
TEST_F(ServingTest, StreamedExpertsReachFourBitsThroughTheSlotMailbox) {
  StartCluster({}, /*streamed=*/true, {"--slot_mailbox=on"});
  constexpr double kFixedLoads = 16;
  ASSERT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_slots_ready") >= kFixedLoads; },
                      std::chrono::seconds(20)))
      << streamer_->Log() << worker_->Log();
  EXPECT_THAT(worker_->Log(), HasSubstr("slot-table changes apply inside decode steps"));
  EXPECT_THAT(streamer_->Log(), HasSubstr("changes posted to its slot mailbox"));
  const Json request = {{"model", "embedded"}, {"prompt", "The quick brown fox"}, {"max_tokens", 48},
                        {"temperature", 0}, {"ignore_eos", true}};
  EXPECT_EQ(Stream("/v1/completions", request).finish, "length");
  EXPECT_GT(Metric(worker_ports_.http, "nq_expert_calls_total{bits=\"4\"}"), 0);
  EXPECT_TRUE(WaitFor(
      [&] { return Metric(streamer_ports_.http, "nq_streamer_slot_loads_total{result=\"ready\"}") > kFixedLoads; },
      std::chrono::seconds(10)))
      << streamer_->Log();
  EXPECT_GE(Metric(streamer_ports_.http, "nq_streamer_mailbox_posts_total{kind=\"ready\"}"),
            Metric(streamer_ports_.http, "nq_streamer_slot_loads_total{result=\"ready\"}"));
  EXPECT_GT(Metric(streamer_ports_.http, "nq_streamer_mailbox_lag_seconds_count"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_updates_rejected_total"), 0);
  for (int port : {worker_ports_.http, streamer_ports_.http}) {
    absl::StatusOr<std::string> checked = PromtoolCheck(HttpGet(port, "/metrics").body);
    EXPECT_TRUE(checked.ok()) << checked.status();
  }
}

TEST_F(ServingTest, KillingTheStreamerMidGenerationKeepsTheStreamGoingAndARestartResyncs) {
  KillTheStreamerMidGeneration({});
}

// The same through the slot mailbox: the restarted streamer adopts what the mailbox published
// (the worker publishes the dead streamer's last posts before its hello).
TEST_F(ServingTest, KillingTheStreamerMidGenerationWithASlotMailboxResyncs) {
  KillTheStreamerMidGeneration({"--slot_mailbox=on"});
}

}  // namespace

void ServingTest::KillTheStreamerMidGeneration(const std::vector<std::string>& worker_extra) {
  StartCluster({}, /*streamed=*/true, worker_extra);
  ASSERT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_slots_ready") >= 4; },
                      std::chrono::seconds(20)));
  Json body = {{"model", "embedded"}, {"prompt", "Once upon a time"}, {"max_tokens", 120},
               {"temperature", 0}, {"ignore_eos", true}, {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, "/v1/completions", body.dump());
  ASSERT_TRUE(http.ok());
  ASSERT_EQ(http->Status().value_or(0), 200);
  int events = 0;
  int completion_tokens = 0;
  std::string finish;
  bool killed = false;
  while (true) {
    absl::StatusOr<std::string> event = http->NextEvent();
    ASSERT_TRUE(event.ok()) << "the stream broke: " << event.status();
    if (*event == "[DONE]") break;
    Json chunk = Json::parse(*event, nullptr, false);
    ASSERT_FALSE(chunk.is_discarded()) << *event;
    ASSERT_FALSE(chunk.contains("error")) << *event;
    if (chunk.contains("usage") && !chunk["usage"].is_null()) {
      completion_tokens = chunk["usage"]["completion_tokens"].get<int>();
      continue;
    }
    ++events;
    const Json& choice = chunk["choices"][0];
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"].get<std::string>();
    if (events == 10) {
      streamer_->Signal(SIGKILL);  // mid-generation, no drain
      ASSERT_TRUE(streamer_->WaitForExit(std::chrono::seconds(5)).ok());
      killed = true;
    }
  }
  ASSERT_TRUE(killed);
  EXPECT_EQ(finish, "length") << "generation went on at 2 bits to max_tokens";
  // Every token reached the client (an event may carry several: accepted MTP drafts arrive
  // with the step that verified them).
  EXPECT_EQ(completion_tokens, 120);
  EXPECT_GT(events, 10) << "the stream went on after the kill";
  EXPECT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_streamer_connected") == 0; },
                      std::chrono::seconds(10)));
  // The worker kept what it had READY; a restarted streamer adopts it and loads again.
  const double ready_before = Metric(worker_ports_.http, "nq_worker_slots_ready");
  EXPECT_GE(ready_before, 4);
  streamer_.emplace(StartStreamer(streamer_ports_, StreamerFlags(true)));
  ASSERT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_streamer_connected") == 1; },
                      std::chrono::seconds(20)))
      << worker_->Log();
  EXPECT_TRUE(WaitFor([&] { return streamer_->Log().find("READY slots adopted") != std::string::npos; },
                      std::chrono::seconds(5)));
  EXPECT_THAT(streamer_->Log(), HasSubstr(absl::StrCat(static_cast<int>(ready_before), " READY slots adopted")));
  body["max_tokens"] = 40;
  body.erase("stream");
  absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/completions", body);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->first, 200) << reply->second.dump();
  EXPECT_TRUE(WaitFor([&] { return Metric(streamer_ports_.http, "nq_streamer_routing_tokens_total") >= 40; },
                      std::chrono::seconds(10)));
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_integrity_failures_total"), 0);
  EXPECT_EQ(Metric(worker_ports_.http, "nq_worker_slot_updates_rejected_total"), 0);
}

namespace {

TEST_F(ServingTest, NqTraceRecordsTheRunningWorkerAndReplayEvaluatesIt) {
  // No worker at the address: a clear error, no trace.
  absl::StatusOr<ChildProcess> orphan = ChildProcess::Start(
      NQ_TOOL_BIN, {"trace", "--worker=127.0.0.1:1", "--out=" + absl::StrCat(log_dir_, "/none.trace")},
      LogPath("trace-nobody"));
  ASSERT_TRUE(orphan.ok());
  absl::StatusOr<int> orphan_code = orphan->WaitForExit(std::chrono::seconds(20));
  ASSERT_TRUE(orphan_code.ok());
  EXPECT_NE(*orphan_code, 0);
  EXPECT_THAT(orphan->Log(), HasSubstr("GetInfo of worker 127.0.0.1:1"));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(log_dir_, "/none.trace")));

  StartCluster({}, /*streamed=*/true);
  const std::string trace = absl::StrCat(log_dir_, "/live.trace");
  absl::StatusOr<ChildProcess> tracer = ChildProcess::Start(
      NQ_TOOL_BIN, {"trace", absl::StrCat("--worker=127.0.0.1:", worker_ports_.grpc), "--out=" + trace,
                    "--trace_tokens=40", "--seconds=60"},
      LogPath("trace"));
  ASSERT_TRUE(tracer.ok()) << tracer.status();
  ASSERT_TRUE(WaitFor([&] { return tracer->Log().find("recording from") != std::string::npos; },
                      std::chrono::seconds(10)))
      << tracer->Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the watch is registered
  const Json request = {{"model", "embedded"}, {"prompt", "Once upon a time there was"}, {"max_tokens", 48},
                        {"temperature", 0}, {"ignore_eos", true}};
  absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/completions", request);
  ASSERT_TRUE(reply.ok());
  ASSERT_EQ(reply->first, 200);
  absl::StatusOr<int> code = tracer->WaitForExit(std::chrono::seconds(20));
  ASSERT_TRUE(code.ok() && *code == 0) << tracer->Log();
  EXPECT_THAT(tracer->Log(), HasSubstr("x 4 MoE layers"));  // glm5_nano: layers 1-4
  absl::StatusOr<ChildProcess> replay = ChildProcess::Start(
      NQ_TOOL_BIN, {"replay", "--trace=" + trace, "--release_dir=" + *model_dir_ + "/release", "--slots=2"},
      LogPath("replay"));
  ASSERT_TRUE(replay.ok());
  code = replay->WaitForExit(std::chrono::seconds(20));
  ASSERT_TRUE(code.ok() && *code == 0) << replay->Log();
  EXPECT_THAT(replay->Log(), HasSubstr("predictor v0"));
  EXPECT_THAT(replay->Log(), HasSubstr("oracle"));
}

TEST_F(ServingTest, AWorkerKilledMidGenerationReleasesItsArena) {
  StartCluster({}, /*streamed=*/true);
  ASSERT_TRUE(WaitFor([&] { return Metric(worker_ports_.http, "nq_worker_slots_ready") >= 4; },
                      std::chrono::seconds(20)));
  const std::string log = worker_->Log();
  // "arena shm /nq-arena-r0-... (N bytes)"
  constexpr std::string_view kPrefix = "arena shm ";
  const size_t at = log.find(std::string(kPrefix) + "/nq-arena-");
  ASSERT_NE(at, std::string::npos) << log;
  const size_t name_at = at + kPrefix.size();
  const std::string arena = log.substr(name_at, log.find(' ', name_at) - name_at);
  ASSERT_TRUE(std::filesystem::exists("/dev/shm" + arena)) << arena;
  EXPECT_GT(Metric(streamer_ports_.http, "nq_streamer_mapped_arena_bytes"), 0);

  Json body = {{"model", "embedded"}, {"prompt", "Once"}, {"max_tokens", 200}, {"ignore_eos", true}, {"stream", true}};
  absl::StatusOr<RawHttp> http = RawHttp::Post(router_ports_.http, "/v1/completions", body.dump());
  ASSERT_TRUE(http.ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(http->NextEvent().ok());
  worker_->Signal(SIGKILL);  // mid-generation, while the streamer may be loading into its arena
  ASSERT_TRUE(worker_->WaitForExit(std::chrono::seconds(5)).ok());
  worker_.reset();
  EXPECT_TRUE(WaitFor([&] { return Metric(streamer_ports_.http, "nq_streamer_workers_registered") == 0; },
                      std::chrono::seconds(10)))
      << streamer_->Log();
  EXPECT_EQ(Metric(streamer_ports_.http, "nq_streamer_mapped_arena_bytes"), 0);
  EXPECT_EQ(Metric(streamer_ports_.http, "nq_streamer_sessions_active"), 0);
  EXPECT_EQ(Metric(streamer_ports_.http, "nq_streamer_read_queue_depth"), 0);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + arena)) << "the dead worker's arena was not unlinked";
  EXPECT_THAT(streamer_->Log(), HasSubstr("process gone"));
}

// nq kld --mode live on the committed model: a real nq-streamer serving the embedded
// model's release, the harness registering as a worker (no worker runs here: it would hold
// rank 0). The local modes' smoke on the same model is in tests/tools/kld_test.cc.
TEST_F(ServingTest, NqKldLiveRunsThroughARealStreamer) {
  streamer_ports_ = NewPorts();
  streamer_.emplace(StartStreamer(streamer_ports_, StreamerFlags(true)));
  ASSERT_TRUE(WaitServing(streamer_ports_.grpc)) << streamer_->Log();
  const std::string tokens = absl::StrCat(log_dir_, "/docstrings.json");
  {
    std::ifstream in(std::string(NQ_SOURCE_DIR) + "/models/glm5_nano/eval/docstrings.tokens.json");
    Json ids = Json::parse(in);
    ids.erase(ids.begin() + 96, ids.end());
    std::ofstream(tokens) << ids.dump();
  }
  const std::string report = absl::StrCat(log_dir_, "/live.json");
  absl::StatusOr<ChildProcess> kld = ChildProcess::Start(
      NQ_TOOL_BIN,
      {"kld", "--teacher=" + *model_dir_, "--release=" + *model_dir_ + "/release", "--mode=live",
       absl::StrCat("--streamer=127.0.0.1:", streamer_ports_.grpc), "--tokens=" + tokens, "--window=48", "--slots=4",
       "--out=" + report},
      LogPath("kld"));
  ASSERT_TRUE(kld.ok());
  absl::StatusOr<int> code = kld->WaitForExit(std::chrono::seconds(120));
  ASSERT_TRUE(code.ok() && *code == 0) << kld->Log();
  std::ifstream in(report);
  const Json result = Json::parse(in);
  EXPECT_EQ(result["tokens"], 96);
  EXPECT_GT(result["mean_kl"].get<double>(), 0);
  // The baseline a dead predictor would give: the fixed sets alone (4 of 32 experts per
  // layer, about a quarter of the calls since they are the most used), on the same tokens.
  const std::string fixed_report = absl::StrCat(log_dir_, "/fixed.json");
  absl::StatusOr<ChildProcess> fixed = ChildProcess::Start(
      NQ_TOOL_BIN,
      {"kld", "--teacher=" + *model_dir_, "--release=" + *model_dir_ + "/release", "--mode=fixed-set",
       "--tokens=" + tokens, "--window=48", "--out=" + fixed_report},
      LogPath("kld-fixed"));
  ASSERT_TRUE(fixed.ok());
  code = fixed->WaitForExit(std::chrono::seconds(120));
  ASSERT_TRUE(code.ok() && *code == 0) << fixed->Log();
  std::ifstream fixed_in(fixed_report);
  const Json baseline = Json::parse(fixed_in);
  // Predictor v0 puts experts in the floating slots that the calls then use: more calls run at
  // 4 bits than on the fixed sets alone, and the answer is closer to the teacher.
  const double live_share = result["four_bit_share"]["calls"].get<double>();
  const double fixed_share = baseline["four_bit_share"]["calls"].get<double>();
  // Measured: 0.51 live against 0.24 on the fixed sets (mean KL 0.056 against 0.087).
  EXPECT_GT(live_share, fixed_share + 0.1) << "live " << live_share << ", fixed set " << fixed_share;
  EXPECT_LT(live_share, 1.0);
  EXPECT_LT(result["mean_kl"].get<double>(), baseline["mean_kl"].get<double>());
  EXPECT_GT(Metric(streamer_ports_.http, "nq_streamer_routing_tokens_total"), 90);
}

}  // namespace
}  // namespace nq::testing
