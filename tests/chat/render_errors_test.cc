// RenderChat's refusals (chat.h), the architecture mapping and GenerationOpensReasoning.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "services/chat/chat.h"
#include "tests/common/status_matchers.h"

namespace nq::chat {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

ChatMessage Msg(std::string role, std::string content) {
  ChatMessage m;
  m.role = std::move(role);
  m.content = std::move(content);
  return m;
}

ChatMessage CallMsg(std::string arguments_json) {
  ChatMessage m = Msg("assistant", "");
  m.tool_calls.push_back(ToolCall{"call_1", "get_weather", std::move(arguments_json)});
  return m;
}

class RenderErrorsTest : public ::testing::TestWithParam<ChatFormat> {};

TEST_P(RenderErrorsTest, UnknownRole) {
  Chat chat;
  chat.messages = {Msg("developer", "x"), Msg("user", "hi")};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("message 0: unknown role \"developer\"")));
}

TEST_P(RenderErrorsTest, ToolMessageWithoutCall) {
  Chat chat;
  chat.messages = {Msg("user", "hi"), Msg("tool", "result")};
  EXPECT_THAT(
      RenderChat(GetParam(), chat),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("message 1: tool message without a preceding assistant tool call")));
}

TEST_P(RenderErrorsTest, ToolMessageAfterAnswerThatEndedTheCalls) {
  Chat chat;
  chat.messages = {Msg("user", "hi"), CallMsg("{}"), Msg("tool", "r1"), Msg("assistant", "done"),
                   Msg("tool", "late")};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("message 4: tool message")));
}

TEST_P(RenderErrorsTest, SeveralToolResultsAfterOneCallMessageAreFine) {
  Chat chat;
  chat.messages = {Msg("user", "hi"), CallMsg("{\"city\": \"Oslo\"}"), Msg("tool", "r1"),
                   Msg("tool", "r2")};
  EXPECT_THAT(RenderChat(GetParam(), chat), IsOk());
}

TEST_P(RenderErrorsTest, ToolCallsOnUserMessage) {
  Chat chat;
  ChatMessage user = Msg("user", "hi");
  user.tool_calls.push_back(ToolCall{"c", "f", "{}"});
  chat.messages = {user};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("message 0: tool_calls on a \"user\" message")));
}

TEST_P(RenderErrorsTest, ReasoningOnSystemMessage) {
  Chat chat;
  ChatMessage system = Msg("system", "s");
  system.reasoning_content = "r";
  chat.messages = {system, Msg("user", "hi")};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reasoning_content on a")));
}

TEST_P(RenderErrorsTest, ToolCallWithoutName) {
  Chat chat;
  ChatMessage call = CallMsg("{}");
  call.tool_calls[0].name.clear();
  chat.messages = {Msg("user", "hi"), call};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tool call 0 has no name")));
}

TEST_P(RenderErrorsTest, ToolDefinitionProblems) {
  Chat chat;
  chat.messages = {Msg("user", "hi")};
  chat.tools = {ToolDefinition{"", "d", "{}"}};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tool 0 has no name")));
  chat.tools = {ToolDefinition{"f", "d", "{\"type\": "}};
  EXPECT_THAT(RenderChat(GetParam(), chat),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tool \"f\": parameters are not valid JSON")));
}

TEST_P(RenderErrorsTest, EmptyChatRendersThePrefixOnly) {
  Chat chat;
  const absl::StatusOr<std::string> out = RenderChat(GetParam(), chat);
  ASSERT_THAT(out, IsOk());
  EXPECT_EQ(*out, GetParam() == ChatFormat::kGlm5 ? "[gMASK]<sop>" : "<｜begin▁of▁sentence｜>");
}

INSTANTIATE_TEST_SUITE_P(AllFormats, RenderErrorsTest,
                         ::testing::Values(ChatFormat::kGlm5, ChatFormat::kDeepSeekV3),
                         [](const ::testing::TestParamInfo<ChatFormat>& info) {
                           return std::string(ChatFormatName(info.param));
                         });

TEST(RenderGlm5Test, ArgumentsMustBeAJsonObject) {
  Chat chat;
  chat.messages = {Msg("user", "hi"), CallMsg("[1, 2]")};
  EXPECT_THAT(RenderChat(ChatFormat::kGlm5, chat),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("message 1 tool call 0 (\"get_weather\"): arguments are not a "
                                 "JSON object")));
  chat.messages[1] = CallMsg("{\"city\": ");
  EXPECT_THAT(
      RenderChat(ChatFormat::kGlm5, chat),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("arguments are not valid JSON")));
}

TEST(RenderGlm5Test, EmptyArgumentsAreAnEmptyObject) {
  Chat chat;
  chat.messages = {Msg("user", "hi"), CallMsg("")};
  const absl::StatusOr<std::string> out = RenderChat(ChatFormat::kGlm5, chat);
  ASSERT_THAT(out, IsOk());
  EXPECT_THAT(*out, HasSubstr("<tool_call>get_weather</tool_call>"));
}

TEST(RenderDeepSeekV3Test, ArgumentsArePastedVerbatim) {
  Chat chat;
  chat.messages = {Msg("user", "hi"), CallMsg("not json at all")};
  const absl::StatusOr<std::string> out = RenderChat(ChatFormat::kDeepSeekV3, chat);
  ASSERT_THAT(out, IsOk());
  EXPECT_THAT(*out, HasSubstr("```json\nnot json at all\n```"));
}

TEST(ChatFormatTest, Architectures) {
  EXPECT_THAT(ChatFormatForArchitecture("GlmMoeDsaForCausalLM"), IsOk());
  EXPECT_EQ(*ChatFormatForArchitecture("GlmMoeDsaForCausalLM"), ChatFormat::kGlm5);
  EXPECT_EQ(*ChatFormatForArchitecture("DeepseekV3ForCausalLM"), ChatFormat::kDeepSeekV3);
  EXPECT_THAT(ChatFormatForArchitecture("LlamaForCausalLM"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("LlamaForCausalLM")));
  EXPECT_EQ(ChatFormatName(ChatFormat::kGlm5), "glm5");
  EXPECT_EQ(ChatFormatName(ChatFormat::kDeepSeekV3), "deepseek_v3");
}

TEST(ChatFormatTest, GenerationOpensReasoning) {
  Chat chat;
  chat.add_generation_prompt = true;
  EXPECT_TRUE(GenerationOpensReasoning(ChatFormat::kGlm5, chat));
  chat.enable_thinking = true;
  EXPECT_TRUE(GenerationOpensReasoning(ChatFormat::kGlm5, chat));
  chat.enable_thinking = false;
  EXPECT_FALSE(GenerationOpensReasoning(ChatFormat::kGlm5, chat));
  chat.enable_thinking.reset();
  chat.add_generation_prompt = false;
  EXPECT_FALSE(GenerationOpensReasoning(ChatFormat::kGlm5, chat));
  chat.add_generation_prompt = true;
  EXPECT_FALSE(GenerationOpensReasoning(ChatFormat::kDeepSeekV3, chat));
}

}  // namespace
}  // namespace nq::chat
