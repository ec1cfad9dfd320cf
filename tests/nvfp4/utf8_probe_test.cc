// `nq probe-utf8` against tiny fake OpenAI servers: a clean one passes; one that emits U+FFFD,
// broken tool-call JSON, bytes that are not UTF-8, or empty outputs is caught.
#include "services/nvfp4/utf8_probe.h"

#include <httplib.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/common/status_matchers.h"

namespace nq::nvfp4 {
namespace {

using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// What the fake server answers to one chat request: (content, tool-call arguments or "").
using Answer = std::function<std::pair<std::string, std::string>(const Json& request)>;

class FakeOpenAiServer {
 public:
  // A non-empty `raw_body` is sent as is to every chat request.
  explicit FakeOpenAiServer(Answer answer, std::string raw_body = "") {
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object":"list","data":[{"id":"fake-nvfp4","object":"model"}]})", "application/json");
    });
    server_.Post("/v1/chat/completions", [this, answer, raw_body](const httplib::Request& req,
                                                                  httplib::Response& res) {
      const Json request = Json::parse(req.body);
      ++requests_;
      last_model_ = request["model"];
      if (!raw_body.empty()) {
        res.set_content(raw_body, "application/json");
        return;
      }
      auto [content, arguments] = answer(request);
      Json message = {{"role", "assistant"}, {"content", content}};
      if (!arguments.empty()) {
        message["tool_calls"] = Json::array(
            {{{"id", "call_0"}, {"type", "function"}, {"function", {{"name", "lookup_place"}, {"arguments", arguments}}}}});
      }
      if (request.value("stream", false)) {
        // Two deltas per answer, split inside the arguments, as a streaming server sends them.
        Json first = message, second = {{"content", ""}};
        if (!arguments.empty()) {
          const size_t half = arguments.size() / 2;
          first["tool_calls"][0]["index"] = 0;
          first["tool_calls"][0]["function"]["arguments"] = arguments.substr(0, half);
          second["tool_calls"] = Json::array({{{"index", 0}, {"function", {{"arguments", arguments.substr(half)}}}}});
        }
        std::string body = "data: " + Json{{"choices", {{{"index", 0}, {"delta", first}}}}}.dump() + "\n\n";
        body += "data: " + Json{{"choices", {{{"index", 0}, {"delta", second}}}}}.dump() + "\n\n";
        body += "data: [DONE]\n\n";
        res.set_content(body, "text/event-stream");
        return;
      }
      res.set_content(Json{{"choices", {{{"index", 0}, {"message", message}}}}}.dump(), "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeOpenAiServer() {
    server_.stop();
    thread_.join();
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }
  int requests() const { return requests_; }
  std::string last_model() const { return last_model_; }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> requests_{0};
  std::string last_model_;
};

std::pair<std::string, std::string> CleanAnswer(const Json& request) {
  if (request.contains("tools")) return {"", R"({"city": "서울", "note": "맑음 ☀️ 東京 москва"})"};
  return {"안녕하세요. こんにちは。你好。வணக்கம். مرحبا. Привет. नमस्ते. 😀🎉", ""};
}

ProbeOptions Options(const FakeOpenAiServer& server, int runs = 1) {
  ProbeOptions options;
  options.url = server.url();
  options.runs = runs;
  return options;
}

int64_t Sum(const ProbeReport& report, int64_t LanguageTally::*field) {
  int64_t total = 0;
  for (const LanguageTally& t : report.languages) total += t.*field;
  return total;
}

TEST(Utf8Probe, CleanServerPasses) {
  FakeOpenAiServer server(CleanAnswer);
  for (bool stream : {false, true}) {
    ProbeOptions options = Options(server, 2);
    options.stream = stream;
    absl::StatusOr<ProbeReport> report = RunUtf8Probe(options);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->Clean()) << ProbeText(*report);
    EXPECT_EQ(report->model, "fake-nvfp4");
    ASSERT_EQ(report->languages.size(), 9u);
    EXPECT_EQ(report->languages[0].language, "korean");
    EXPECT_EQ(Sum(*report, &LanguageTally::requests), 36);
    EXPECT_EQ(Sum(*report, &LanguageTally::tool_calls), 18) << "stream " << stream;
  }
  EXPECT_EQ(server.requests(), 72);
  EXPECT_EQ(server.last_model(), "fake-nvfp4");
}

TEST(Utf8Probe, CatchesReplacementCharactersPerLanguage) {
  FakeOpenAiServer server([](const Json& request) -> std::pair<std::string, std::string> {
    const std::string prompt = request["messages"][0]["content"];
    if (prompt.find("서울") != std::string::npos) {
      std::string long_tail;
      for (int i = 0; i < 100; ++i) long_tail += "가";
      return {"서울\xEF\xBF\xBD의 가을 \xEF\xBF\xBD " + long_tail, ""};
    }
    return CleanAnswer(request);
  });
  absl::StatusOr<ProbeReport> report = RunUtf8Probe(Options(server, 3));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->Clean());
  EXPECT_EQ(report->languages[0].replacement_chars, 6);  // 2 per answer x 3 runs
  EXPECT_EQ(Sum(*report, &LanguageTally::replacement_chars), 6);
  EXPECT_THAT(ProbeText(*report), HasSubstr("CORRUPTION"));
  // Examples are cut on a character boundary: the report serialises without a UTF-8 error.
  ASSERT_FALSE(report->examples.empty());
  EXPECT_TRUE(IsValidUtf8(report->examples[0]));
  EXPECT_NO_THROW(ProbeJson(*report).dump());
}

TEST(Utf8Probe, CatchesBrokenToolCallJson) {
  FakeOpenAiServer server([](const Json& request) -> std::pair<std::string, std::string> {
    if (request.contains("tools")) return {"", R"({"city": "札幌", "note": "晴れ)"};  // cut short
    return CleanAnswer(request);
  });
  for (bool stream : {false, true}) {
    ProbeOptions options = Options(server);
    options.stream = stream;
    absl::StatusOr<ProbeReport> report = RunUtf8Probe(options);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_FALSE(report->Clean());
    EXPECT_EQ(Sum(*report, &LanguageTally::malformed_tool_calls), 9);
    EXPECT_EQ(Sum(*report, &LanguageTally::replacement_chars), 0);
  }
}

TEST(Utf8Probe, EmptyOutputsAndInvalidBytesAreNotClean) {
  FakeOpenAiServer empty([](const Json&) { return std::pair<std::string, std::string>{"  ", ""}; });
  absl::StatusOr<ProbeReport> report = RunUtf8Probe(Options(empty));
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->Clean());
  EXPECT_EQ(Sum(*report, &LanguageTally::empty_outputs), 18);

  // A server that splits a 3-byte character and does not repair it.
  FakeOpenAiServer split(CleanAnswer, "{\"choices\":[{\"message\":{\"role\":\"assistant\",\"content\":\"\xEC\xA0\"}}]}");
  report = RunUtf8Probe(Options(split));
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->Clean());
  EXPECT_EQ(Sum(*report, &LanguageTally::invalid_utf8), 18);
}

TEST(Utf8Probe, BodiesThatAreNotOpenAiAnswersCountAsFailedRequests) {
  for (const char* body : {R"({"choices": ["text"]})", R"({"choices": []})", "not json", R"([1, 2])"}) {
    FakeOpenAiServer server(CleanAnswer, body);
    absl::StatusOr<ProbeReport> report = RunUtf8Probe(Options(server));
    ASSERT_TRUE(report.ok()) << body;
    EXPECT_FALSE(report->Clean()) << body;
    EXPECT_EQ(Sum(*report, &LanguageTally::failed_requests), 18) << body;
  }
}

TEST(Utf8Probe, RefusesBadOptionsAndDeadServers) {
  ProbeOptions options;
  options.url = "ftp://example.com";
  EXPECT_THAT(RunUtf8Probe(options).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("http://")));
  options.url = "http://127.0.0.1:1/v2/chat";
  EXPECT_THAT(RunUtf8Probe(options).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("server root")));
  options.url = "http://127.0.0.1:1";
  options.runs = 0;
  EXPECT_THAT(RunUtf8Probe(options).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--runs")));
  options.runs = 1;
  EXPECT_THAT(RunUtf8Probe(options).status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("/v1/models")));
}

TEST(Utf8, ValidatorAndCounter) {
  EXPECT_TRUE(IsValidUtf8("plain, 한국어, 😀"));
  EXPECT_FALSE(IsValidUtf8("\xEC\xA0"));          // truncated
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xF4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_EQ(CountReplacementChars("a\xEF\xBF\xBD\xEF\xBF\xBDz"), 2);
}

}  // namespace
}  // namespace nq::nvfp4
