// RenderPlainChat (chat.h): a base model's chat, the messages' text and nothing else.
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

Chat UserSays(std::string content) {
  Chat chat;
  chat.messages.push_back(Msg("user", std::move(content)));
  chat.add_generation_prompt = true;
  return chat;
}

TEST(PlainChatTest, TheReadmeExampleIsItsTextAndANewline) {
  absl::StatusOr<std::string> prompt = RenderPlainChat(UserSays("def fibonacci(n):"));
  ASSERT_THAT(prompt.status(), IsOk());
  EXPECT_EQ(*prompt, "def fibonacci(n):\n");
}

TEST(PlainChatTest, MessagesFollowEachOtherWithoutRolesOrMarkup) {
  Chat chat = UserSays("import os\n");
  chat.messages.insert(chat.messages.begin(), Msg("system", "# Python 3"));
  chat.messages.push_back(Msg("assistant", "def main():"));
  chat.messages.push_back(Msg("user", "    return 0"));
  chat.enable_thinking = false;  // nothing to switch off, so accepted
  absl::StatusOr<std::string> prompt = RenderPlainChat(chat);
  ASSERT_THAT(prompt.status(), IsOk());
  EXPECT_EQ(*prompt, "# Python 3\nimport os\ndef main():\n    return 0\n");
  // An empty conversation renders to nothing.
  EXPECT_EQ(RenderPlainChat(Chat{}).value(), "");
}

TEST(PlainChatTest, WhatPlainTextCannotCarryIsRefusedByName) {
  Chat tools = UserSays("x");
  tools.tools.push_back(ToolDefinition{"get_weather", "", ""});
  EXPECT_THAT(RenderPlainChat(tools).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tools")));

  Chat thinking = UserSays("x");
  thinking.enable_thinking = true;
  EXPECT_THAT(RenderPlainChat(thinking).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("enable_thinking")));

  Chat reasoning = UserSays("x");
  ChatMessage answer = Msg("assistant", "y");
  answer.reasoning_content = "because";
  reasoning.messages.push_back(answer);
  EXPECT_THAT(RenderPlainChat(reasoning).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("message 1: the plain chat format has no "
                                                                     "reasoning_content")));

  Chat calls = UserSays("x");
  ChatMessage call = Msg("assistant", "");
  call.tool_calls.push_back(ToolCall{"call_1", "get_weather", "{}"});
  calls.messages.push_back(call);
  calls.messages.push_back(Msg("tool", "sunny"));
  EXPECT_THAT(RenderPlainChat(calls).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("message 1: the plain chat format has no tool")));

  // RenderChat's own checks come first.
  EXPECT_THAT(RenderPlainChat(Chat{.messages = {Msg("narrator", "x")}}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown role \"narrator\"")));
}

}  // namespace
}  // namespace nq::chat
