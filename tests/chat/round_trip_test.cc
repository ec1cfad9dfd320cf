// Render an assistant turn with tool calls, take the part the model would have generated,
// parse it back: the same reasoning, content and calls come out.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/match.h"
#include "services/chat/chat.h"
#include "services/chat/output_parser.h"
#include "tests/common/status_matchers.h"

namespace nq::chat {
namespace {

using ::nq::testing::IsOk;
using Json = nlohmann::ordered_json;

const ToolDefinition kWeather{"get_weather", "Weather",
                              R"({"type": "object", "properties": {"city": {"type": "string"},)"
                              R"( "code": {"type": "string"}, "days": {"type": "integer"}}})"};

ChatMessage Assistant(std::string content, std::string reasoning, std::vector<ToolCall> calls) {
  ChatMessage m;
  m.role = "assistant";
  m.content = std::move(content);
  m.reasoning_content = std::move(reasoning);
  m.tool_calls = std::move(calls);
  return m;
}

Chat ChatEndingWith(ChatMessage assistant) {
  Chat chat;
  ChatMessage user;
  user.role = "user";
  user.content = "Weather in 北京 and Zürich?";
  chat.messages = {user, std::move(assistant)};
  chat.tools = {kWeather};
  return chat;
}

// The rendered text after `prompt` (the generation prompt the model continued from).
std::string GeneratedPart(const std::string& rendered, const std::string& prompt) {
  const size_t at = rendered.rfind(prompt);
  EXPECT_NE(at, std::string::npos) << rendered;
  return at == std::string::npos ? "" : rendered.substr(at + prompt.size());
}

void ExpectSameCalls(const std::vector<ToolCall>& got, const std::vector<ToolCall>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].name, want[i].name);
    EXPECT_EQ(Json::parse(got[i].arguments_json), Json::parse(want[i].arguments_json))
        << got[i].arguments_json << " vs " << want[i].arguments_json;
  }
}

TEST(RoundTripTest, Glm5WithReasoning) {
  const std::vector<ToolCall> calls = {
      {"call_a", "get_weather", R"({"city": "北京", "code": "0042", "days": 3})"},
      {"call_b", "get_weather",
       R"({"city": "Zürich", "extra": {"nested": [1, 2.5, null, "x\ny"]}, "ok": false})"}};
  const Chat chat = ChatEndingWith(Assistant("Checking both.", "Two cities: two calls.", calls));
  const absl::StatusOr<std::string> rendered = RenderChat(ChatFormat::kGlm5, chat);
  ASSERT_THAT(rendered, IsOk());
  ParseOptions options;
  options.starts_in_reasoning = true;  // the generation prompt was "<|assistant|><think>"
  options.tools = chat.tools;
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5, GeneratedPart(*rendered, "<|assistant|><think>"), options);
  EXPECT_EQ(out.reasoning_content, "Two cities: two calls.");
  EXPECT_EQ(out.content, "Checking both.");
  ExpectSameCalls(out.tool_calls, calls);  // "0042" stays a string: the schema says so
}

TEST(RoundTripTest, Glm5WithoutReasoning) {
  const std::vector<ToolCall> calls = {{"c", "get_weather", R"({"city": "Oslo", "days": 1})"}};
  const Chat chat = ChatEndingWith(Assistant("", "", calls));
  const absl::StatusOr<std::string> rendered = RenderChat(ChatFormat::kGlm5, chat);
  ASSERT_THAT(rendered, IsOk());
  // Thinking off: the generation prompt was "<|assistant|></think>".
  const ParsedAssistantOutput out =
      ParseAssistantOutput(ChatFormat::kGlm5, GeneratedPart(*rendered, "<|assistant|></think>"));
  EXPECT_EQ(out.content, "");
  ExpectSameCalls(out.tool_calls, calls);
}

TEST(RoundTripTest, DeepSeekV3) {
  const std::vector<ToolCall> calls = {{"c1", "get_weather", R"({"city": "北京"})"},
                                       {"c2", "get_weather", R"({"city": "Zürich", "days": 2})"}};
  const Chat chat = ChatEndingWith(Assistant("", "", calls));
  const absl::StatusOr<std::string> rendered = RenderChat(ChatFormat::kDeepSeekV3, chat);
  ASSERT_THAT(rendered, IsOk());
  // The template closes a message's calls with <｜tool▁calls▁end｜><｜end▁of▁sentence｜>;
  // the router stops at the end-of-sentence token, so the model output ends before it.
  std::string generated = GeneratedPart(*rendered, "<｜Assistant｜>");
  const std::string eos = "<｜end▁of▁sentence｜>";
  ASSERT_TRUE(absl::EndsWith(generated, eos)) << generated;
  generated.resize(generated.size() - eos.size());
  const ParsedAssistantOutput out = ParseAssistantOutput(ChatFormat::kDeepSeekV3, generated);
  EXPECT_EQ(out.content, "");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].arguments_json, calls[0].arguments_json);  // verbatim
  EXPECT_EQ(out.tool_calls[1].arguments_json, calls[1].arguments_json);
  ExpectSameCalls(out.tool_calls, calls);
}

}  // namespace
}  // namespace nq::chat
