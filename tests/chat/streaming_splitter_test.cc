// StreamingSplitter: deltas as text arrives, markers split across chunks, and agreement with
// ParseAssistantOutput for every way of cutting the text.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "services/chat/output_parser.h"

namespace nq::chat {
namespace {

using ::testing::IsEmpty;

struct Collected {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  void Add(const StreamDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    tool_calls.insert(tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
  }
};

// Feeds `text` cut at `cuts` (sorted byte offsets) and checks the stream against the whole
// parse.
void ExpectStreamMatchesWhole(ChatFormat format, const std::string& text,
                              const std::vector<size_t>& cuts, const ParseOptions& options) {
  StreamingSplitter splitter(format, options);
  Collected got;
  size_t from = 0;
  for (size_t cut : cuts) {
    got.Add(splitter.Push(absl::string_view(text).substr(from, cut - from)));
    from = cut;
  }
  got.Add(splitter.Push(absl::string_view(text).substr(from)));
  got.Add(splitter.Finish());
  const ParsedAssistantOutput whole = ParseAssistantOutput(format, text, options);
  ASSERT_EQ(got.reasoning, whole.reasoning_content);
  ASSERT_EQ(got.content, whole.content);
  ASSERT_EQ(got.tool_calls.size(), whole.tool_calls.size());
  for (size_t i = 0; i < got.tool_calls.size(); ++i) {
    ASSERT_EQ(got.tool_calls[i].id, whole.tool_calls[i].id);
    ASSERT_EQ(got.tool_calls[i].name, whole.tool_calls[i].name);
    ASSERT_EQ(got.tool_calls[i].arguments_json, whole.tool_calls[i].arguments_json);
  }
  EXPECT_EQ(splitter.result().reasoning_unterminated, whole.reasoning_unterminated);
  EXPECT_EQ(splitter.result().tool_call_unterminated, whole.tool_call_unterminated);
  EXPECT_EQ(splitter.result().tool_call_malformed, whole.tool_call_malformed);
}

// Offsets that start a UTF-8 character (the router never cuts inside one).
std::vector<size_t> CharBoundaries(const std::string& text) {
  std::vector<size_t> out;
  for (size_t i = 1; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xc0) != 0x80) out.push_back(i);
  }
  return out;
}

void ExpectAllCutsAgree(ChatFormat format, const std::string& text, const ParseOptions& options) {
  const std::vector<size_t> bounds = CharBoundaries(text);
  SCOPED_TRACE(text);
  ExpectStreamMatchesWhole(format, text, bounds, options);  // one character at a time
  for (size_t cut : bounds) {                               // every split in two
    SCOPED_TRACE(cut);
    ExpectStreamMatchesWhole(format, text, {cut}, options);
  }
  for (size_t i = 0; i + 1 < bounds.size(); i += 3) {  // pairs of nearby cuts
    ExpectStreamMatchesWhole(format, text, {bounds[i], bounds[i + 1]}, options);
  }
}

TEST(StreamingSplitterTest, GlmOutputsAgreeWithWholeParseForEveryCut) {
  ParseOptions reasoning;
  reasoning.starts_in_reasoning = true;
  const std::vector<std::string> outputs = {
      "Think 北京 <x> </thin k></think>Answer <tool< tool_call> 😀",
      "r</think>Check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich"
      "</arg_value><arg_key>n</arg_key><arg_value>2</arg_value></tool_call><tool_call>ping"
      "</tool_call>",
      "cut in reasoning </thi",
      "r</think>cut in a call<tool_call>f<arg_key>k</arg_key><arg_value>v",
      "r</think><tool_call>broken</arg_key></tool_call>after",
  };
  for (const std::string& text : outputs) ExpectAllCutsAgree(ChatFormat::kGlm5, text, reasoning);
  ExpectAllCutsAgree(ChatFormat::kGlm5, "  <think>own block</think>x<tool_call>f</tool_call>", {});
  ExpectAllCutsAgree(ChatFormat::kGlm5, "  <thinking is not a tag", {});
  ExpectAllCutsAgree(ChatFormat::kGlm5, "  ", {});
}

TEST(StreamingSplitterTest, DeepSeekOutputsAgreeWithWholeParseForEveryCut) {
  const std::string call =
      "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      "{\"city\": \"Zürich\"}\n```<｜tool▁call▁end｜>";
  const std::vector<std::string> outputs = {
      "Plain <｜tool answer 😀",
      "Let me see." + std::string("<｜tool▁calls▁begin｜>") + call + "\n" + call +
          "<｜tool▁calls▁end｜>",
      "cut" + std::string("<｜tool▁calls▁begin｜>") + call,
      "<think>r</think>after",
  };
  for (const std::string& text : outputs) ExpectAllCutsAgree(ChatFormat::kDeepSeekV3, text, {});
}

TEST(StreamingSplitterTest, WithholdsOnlyWhatMayStartAMarker) {
  StreamingSplitter splitter(ChatFormat::kGlm5, ParseOptions{});
  StreamDelta d = splitter.Push("Hello <tool");
  EXPECT_EQ(d.content, "Hello ");  // "<tool" may open a call
  d = splitter.Push("box> there");
  EXPECT_EQ(d.content, "<toolbox> there");  // it did not
  d = splitter.Push(" <tool_c");
  EXPECT_EQ(d.content, " ");
  d = splitter.Push("all>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>");
  EXPECT_TRUE(d.empty());  // inside a call: nothing until it closes
  d = splitter.Push("</tool_ca");
  EXPECT_TRUE(d.empty());
  d = splitter.Push("ll>done");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_EQ(d.tool_calls[0].arguments_json, R"({"city":"Oslo"})");
  EXPECT_EQ(d.content, "done");
  EXPECT_TRUE(splitter.Finish().empty());
  EXPECT_EQ(splitter.result().content, "Hello <toolbox> there done");
}

TEST(StreamingSplitterTest, ReasoningDeltasThenContentDeltas) {
  ParseOptions options;
  options.starts_in_reasoning = true;
  StreamingSplitter splitter(ChatFormat::kGlm5, options);
  StreamDelta d = splitter.Push("Let me think</");
  EXPECT_EQ(d.reasoning, "Let me think");
  EXPECT_THAT(d.content, IsEmpty());
  d = splitter.Push("think");
  EXPECT_TRUE(d.empty());
  d = splitter.Push(">The answer");
  EXPECT_THAT(d.reasoning, IsEmpty());
  EXPECT_EQ(d.content, "The answer");
  d = splitter.Push(" is 4.");
  EXPECT_EQ(d.content, " is 4.");
  EXPECT_TRUE(splitter.Finish().empty());
  EXPECT_FALSE(splitter.result().reasoning_unterminated);
}

TEST(StreamingSplitterTest, LeadingThinkIsDecidedOnlyOnceItCan) {
  StreamingSplitter splitter(ChatFormat::kDeepSeekV3, ParseOptions{});
  EXPECT_TRUE(splitter.Push("\n").empty());
  EXPECT_TRUE(splitter.Push("<th").empty());
  StreamDelta d = splitter.Push("ink>why");
  EXPECT_EQ(d.reasoning, "why");
  d = splitter.Push("</think>ok");
  EXPECT_EQ(d.content, "ok");

  StreamingSplitter other(ChatFormat::kDeepSeekV3, ParseOptions{});
  EXPECT_TRUE(other.Push("<th").empty());
  d = other.Push("e end");
  EXPECT_EQ(d.content, "<the end");
}

TEST(StreamingSplitterTest, DeepSeekMarkerSplitInsideAMultiByteMarker) {
  StreamingSplitter splitter(ChatFormat::kDeepSeekV3, ParseOptions{});
  StreamDelta d = splitter.Push("Sure<｜tool▁cal");
  EXPECT_EQ(d.content, "Sure");
  d = splitter.Push("ls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```");
  EXPECT_TRUE(d.empty());
  d = splitter.Push("<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].name, "f");
  EXPECT_EQ(d.tool_calls[0].arguments_json, "{}");
}

TEST(StreamingSplitterTest, FinishReleasesWithheldText) {
  StreamingSplitter splitter(ChatFormat::kGlm5, ParseOptions{});
  EXPECT_EQ(splitter.Push("a <tool_").content, "a ");
  const StreamDelta d = splitter.Finish();
  EXPECT_EQ(d.content, "<tool_");
  EXPECT_EQ(splitter.result().content, "a <tool_");
  EXPECT_FALSE(splitter.result().tool_call_unterminated);
  EXPECT_TRUE(splitter.Push("more").empty());  // after Finish nothing is taken
}

}  // namespace
}  // namespace nq::chat
