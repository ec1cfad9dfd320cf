// libFuzzer target for chat message rendering (scripts/fuzz.sh chat_render).
//
// The router renders every chat request's messages, roles, tool calls (their arguments are
// client JSON) and tool definitions with the model's template, so on any conversation
// RenderChat and RenderPlainChat must return a Status without crashing or tripping a sanitizer,
// an accepted conversation renders the same bytes twice, and the plain rendering carries every
// message's content. The input is turned into a conversation field by field
// (FuzzedDataProvider), so the renderers' rules, not a JSON parser, take the mutations.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_require.h"
#include "services/chat/chat.h"

using nq::fuzz::Require;

namespace {

constexpr const char* kRoles[] = {"system", "user", "assistant", "tool", "developer"};

nq::chat::Chat MakeChat(FuzzedDataProvider& in) {
  nq::chat::Chat chat;
  const int messages = in.ConsumeIntegralInRange(0, 8);
  for (int m = 0; m < messages; ++m) {
    nq::chat::ChatMessage message;
    message.role = kRoles[in.ConsumeIntegralInRange<std::size_t>(0, std::size(kRoles) - 1)];
    message.content = in.ConsumeRandomLengthString(256);
    if (in.ConsumeBool()) message.reasoning_content = in.ConsumeRandomLengthString(64);
    const int calls = in.ConsumeIntegralInRange(0, 2);
    for (int c = 0; c < calls; ++c) {
      message.tool_calls.push_back({.id = in.ConsumeRandomLengthString(16),
                                    .name = in.ConsumeRandomLengthString(16),
                                    .arguments_json = in.ConsumeRandomLengthString(128)});
    }
    if (in.ConsumeBool()) message.tool_call_id = in.ConsumeRandomLengthString(16);
    chat.messages.push_back(std::move(message));
  }
  const int tools = in.ConsumeIntegralInRange(0, 2);
  for (int t = 0; t < tools; ++t) {
    chat.tools.push_back({.name = in.ConsumeRandomLengthString(16),
                          .description = in.ConsumeRandomLengthString(64),
                          .parameters_json = in.ConsumeRandomLengthString(128)});
  }
  chat.add_generation_prompt = in.ConsumeBool();
  switch (in.ConsumeIntegralInRange(0, 2)) {
    case 0: break;
    case 1: chat.enable_thinking = false; break;
    default: chat.enable_thinking = true; break;
  }
  return chat;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const nq::chat::Chat chat = MakeChat(in);
  for (nq::chat::ChatFormat format : {nq::chat::ChatFormat::kGlm5, nq::chat::ChatFormat::kDeepSeekV3}) {
    const absl::StatusOr<std::string> rendered = nq::chat::RenderChat(format, chat);
    if (!rendered.ok()) {
      Require(rendered.status().code() == absl::StatusCode::kInvalidArgument);
      Require(!rendered.status().message().empty());
      continue;
    }
    const absl::StatusOr<std::string> again = nq::chat::RenderChat(format, chat);
    Require(again.ok() && *again == *rendered);
    (void)nq::chat::GenerationOpensReasoning(format, chat);
  }
  const absl::StatusOr<std::string> plain = nq::chat::RenderPlainChat(chat);
  if (!plain.ok()) {
    Require(plain.status().code() == absl::StatusCode::kInvalidArgument && !plain.status().message().empty());
    return 0;
  }
  // Plain text is the contents in order: each message's content is in it, at or after the last.
  std::size_t at = 0;
  for (const nq::chat::ChatMessage& message : chat.messages) {
    const std::size_t found = plain->find(message.content, at);
    Require(found != std::string::npos);
    at = found + message.content.size();
  }
  return 0;
}
