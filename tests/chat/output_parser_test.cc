// ParseAssistantOutput on whole outputs of each format, well-formed, truncated and malformed.
#include "services/chat/output_parser.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace nq::chat {
namespace {

using ::testing::IsEmpty;

constexpr char kCallsBegin[] = "<｜tool▁calls▁begin｜>";
constexpr char kCallsEnd[] = "<｜tool▁calls▁end｜>";
constexpr char kCallBegin[] = "<｜tool▁call▁begin｜>";
constexpr char kCallEnd[] = "<｜tool▁call▁end｜>";
constexpr char kSep[] = "<｜tool▁sep｜>";

ParseOptions Reasoning() {
  ParseOptions o;
  o.starts_in_reasoning = true;
  return o;
}

std::string DsCall(const std::string& name, const std::string& args) {
  return std::string(kCallBegin) + "function" + kSep + name + "\n```json\n" + args + "\n```" +
         kCallEnd;
}

TEST(ParseGlmTest, ReasoningContentAndCalls) {
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5,
      "Need weather.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key>"
      "<arg_value>北京</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
      "<tool_call>search<arg_key>filters</arg_key><arg_value>{\"tags\": [\"a\"], \"n\": null}"
      "</arg_value><arg_key>exact</arg_key><arg_value>true</arg_value></tool_call>",
      Reasoning());
  EXPECT_EQ(out.reasoning_content, "Need weather.");
  EXPECT_EQ(out.content, "Let me check.");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].id, "call_0");
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  EXPECT_EQ(out.tool_calls[0].arguments_json, R"({"city":"北京","days":3})");
  EXPECT_EQ(out.tool_calls[1].id, "call_1");
  EXPECT_EQ(out.tool_calls[1].arguments_json,
            R"({"filters":{"tags":["a"],"n":null},"exact":true})");
  EXPECT_FALSE(out.reasoning_unterminated || out.tool_call_unterminated || out.tool_call_malformed);
}

TEST(ParseGlmTest, ThinkingOffHasNoReasoning) {
  const ParsedAssistantOutput out = ParseAssistantOutput(ChatFormat::kGlm5, "Just the answer.");
  EXPECT_EQ(out.content, "Just the answer.");
  EXPECT_THAT(out.reasoning_content, IsEmpty());
}

TEST(ParseGlmTest, OutputThatOpensItsOwnThinkBlock) {
  const ParsedAssistantOutput out =
      ParseAssistantOutput(ChatFormat::kGlm5, "\n<think>hmm</think>answer");
  EXPECT_EQ(out.reasoning_content, "hmm");
  EXPECT_EQ(out.content, "answer");
}

TEST(ParseGlmTest, StringValuesThatLookLikeJson) {
  // Without a schema "42" and "true" read as JSON; a raw JSON string literal stays text.
  const std::string text =
      "<tool_call>f<arg_key>q</arg_key><arg_value>42</arg_value><arg_key>s</arg_key>"
      "<arg_value>\"quoted\"</arg_value><arg_key>t</arg_key><arg_value>plain text</arg_value>"
      "</tool_call>";
  ParsedAssistantOutput out = ParseAssistantOutput(ChatFormat::kGlm5, text);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments_json, R"({"q":42,"s":"\"quoted\"","t":"plain text"})");
  // The schema types q as a string: it stays "42".
  ParseOptions options;
  options.tools = {ToolDefinition{
      "f", "", R"({"type": "object", "properties": {"q": {"type": ["string", "null"]}}})"}};
  out = ParseAssistantOutput(ChatFormat::kGlm5, text, options);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments_json, R"({"q":"42","s":"\"quoted\"","t":"plain text"})");
}

TEST(ParseGlmTest, Glm45StyleNewlinesAndNoArguments) {
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5,
      "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
      "<tool_call>ping</tool_call>");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].arguments_json, R"({"city":"Paris"})");
  EXPECT_EQ(out.tool_calls[1].name, "ping");
  EXPECT_EQ(out.tool_calls[1].arguments_json, "{}");
}

TEST(ParseGlmTest, ValueWithNewlinesKeepsThem) {
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5,
      "<tool_call>write<arg_key>text</arg_key><arg_value>line 1\nline 2\n</arg_value></tool_call>");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments_json, R"({"text":"line 1\nline 2\n"})");
}

TEST(ParseGlmTest, UnterminatedReasoningStaysReasoning) {
  const ParsedAssistantOutput out =
      ParseAssistantOutput(ChatFormat::kGlm5, "thinking and then cut", Reasoning());
  EXPECT_EQ(out.reasoning_content, "thinking and then cut");
  EXPECT_THAT(out.content, IsEmpty());
  EXPECT_TRUE(out.reasoning_unterminated);
}

TEST(ParseGlmTest, UnterminatedToolCallBecomesContent) {
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5, "r</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_va",
      Reasoning());
  EXPECT_EQ(out.reasoning_content, "r");
  EXPECT_EQ(out.content, "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_va");
  EXPECT_THAT(out.tool_calls, IsEmpty());
  EXPECT_TRUE(out.tool_call_unterminated);
  EXPECT_FALSE(out.tool_call_malformed);
}

TEST(ParseGlmTest, MalformedToolCallBecomesContentAndLaterCallsStillParse) {
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5,
      "a<tool_call><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>b"
      "<tool_call>f<arg_key>k</arg_key>no value</tool_call>c<tool_call>g</tool_call>");
  EXPECT_EQ(out.content,
            "a<tool_call><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>b"
            "<tool_call>f<arg_key>k</arg_key>no value</tool_call>c");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "g");
  EXPECT_EQ(out.tool_calls[0].id, "call_0");
  EXPECT_TRUE(out.tool_call_malformed);
}

TEST(ParseGlmTest, ToolCallIdPrefix) {
  ParseOptions options;
  options.tool_call_id_prefix = "call_req7_";
  const ParsedAssistantOutput out = ParseAssistantOutput(
      ChatFormat::kGlm5, "<tool_call>a</tool_call><tool_call>b</tool_call>", options);
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].id, "call_req7_0");
  EXPECT_EQ(out.tool_calls[1].id, "call_req7_1");
}

TEST(ParseDeepSeekV3Test, ContentAndCalls) {
  const std::string text = std::string("I'll look.") + kCallsBegin +
                           DsCall("get_weather", R"({"city": "北京"})") + "\n" +
                           DsCall("search", R"({"q": "x", "n": [1, 2]})") + kCallsEnd;
  const ParsedAssistantOutput out = ParseAssistantOutput(ChatFormat::kDeepSeekV3, text);
  EXPECT_EQ(out.content, "I'll look.");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  EXPECT_EQ(out.tool_calls[0].arguments_json, R"({"city": "北京"})");  // as written
  EXPECT_EQ(out.tool_calls[1].name, "search");
  EXPECT_EQ(out.tool_calls[1].arguments_json, R"({"q": "x", "n": [1, 2]})");
  EXPECT_EQ(out.tool_calls[1].id, "call_1");
}

TEST(ParseDeepSeekV3Test, PlainAnswerAndLeadingThink) {
  EXPECT_EQ(ParseAssistantOutput(ChatFormat::kDeepSeekV3, "Hello!").content, "Hello!");
  const ParsedAssistantOutput out =
      ParseAssistantOutput(ChatFormat::kDeepSeekV3, "<think>\nr\n</think>\n\nHi");
  EXPECT_EQ(out.reasoning_content, "\nr\n");
  EXPECT_EQ(out.content, "\n\nHi");
}

TEST(ParseDeepSeekV3Test, ArgumentsThatAreNotAnObjectMakeTheSectionContent) {
  const std::string text = std::string(kCallsBegin) + DsCall("f", "[1]") + kCallsEnd;
  const ParsedAssistantOutput out = ParseAssistantOutput(ChatFormat::kDeepSeekV3, text);
  EXPECT_EQ(out.content, text);
  EXPECT_THAT(out.tool_calls, IsEmpty());
  EXPECT_TRUE(out.tool_call_malformed);
}

TEST(ParseDeepSeekV3Test, TruncatedSection) {
  const std::string text =
      std::string("x") + kCallsBegin + kCallBegin + "function" + kSep + "f\n```json\n{\"a\"";
  const ParsedAssistantOutput out = ParseAssistantOutput(ChatFormat::kDeepSeekV3, text);
  EXPECT_EQ(out.content, text);
  EXPECT_TRUE(out.tool_call_unterminated);
}

TEST(ParseDeepSeekV3Test, GlmMarkersAreOrdinaryText) {
  const std::string text = "<tool_call>f</tool_call>";
  EXPECT_EQ(ParseAssistantOutput(ChatFormat::kDeepSeekV3, text).content, text);
}

}  // namespace
}  // namespace nq::chat
