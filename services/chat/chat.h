// Chat templates of the served model families, rendered natively (issue #4).
//
// RenderChat produces, byte for byte, what transformers' apply_chat_template(tokenize=False)
// produces with the model's Jinja template (scripts/chat/templates/, README there names the
// sources); tests/chat checks every conversation of scripts/chat/conversations.json against
// fixtures rendered by transformers itself. No Jinja engine is packaged for C++ in Debian, so
// each template is transcribed as code (glm5_renderer.cc, deepseek_v3_renderer.cc).
//
// The types mirror nq.v1.Chat (proto/nq/v1/inference.proto) as plain structs; the router
// converts. proto3 strings cannot be absent, so the template input is derived by these rules
// (scripts/chat/make_chat_fixtures.py applies the same ones when it makes the fixtures):
//   - an empty reasoning_content is absent;
//   - an assistant message with tool calls and empty content has content None for
//     DeepSeek-V3 (its template renders tool calls only then) and "" for GLM (its template
//     would print a None content as the text "None");
//   - GLM's template iterates arguments as a mapping, so arguments_json is parsed into a JSON
//     object ("" counts as {}); DeepSeek-V3's pastes arguments_json verbatim;
//   - a tool definition is {"type": "function", "function": {"name", "description",
//     "parameters"}}, with description omitted when empty and parameters (parsed from
//     parameters_json, key order kept) omitted when parameters_json is empty.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::chat {

// One chat format per model family.
enum class ChatFormat {
  kGlm5,        // GlmMoeDsaForCausalLM (GLM-5); also the GLM-4.7 template it descends from
  kDeepSeekV3,  // DeepseekV3ForCausalLM (DeepSeek-V3's own template)
};

absl::string_view ChatFormatName(ChatFormat format);

// The format of an HF architecture name (config.json "architectures"[0]).
// NOT_FOUND for an architecture without a chat format.
absl::StatusOr<ChatFormat> ChatFormatForArchitecture(absl::string_view architecture);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments_json;  // a JSON object text
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  std::string reasoning_content;     // assistant only
  std::vector<ToolCall> tool_calls;  // assistant only
  std::string tool_call_id;          // tool only (the templates do not render it)
  std::string name;                  // optional (the templates do not render it)
};

struct ToolDefinition {
  std::string name;
  std::string description;
  std::string parameters_json;  // JSON Schema object text; empty: no parameters
};

struct Chat {
  std::vector<ChatMessage> messages;
  std::vector<ToolDefinition> tools;
  bool add_generation_prompt = false;
  std::optional<bool> enable_thinking;  // passed to the template only when set
};

// Renders `chat` with `format`'s template. INVALID_ARGUMENT for a conversation the template
// would fail on (GLM: tool-call arguments that are not a JSON object) and for ones it would
// silently mangle, which the OpenAI API also refuses: an unknown role, tool_calls or
// reasoning_content on a message that is not an assistant's, a tool call without a name, a
// tool message that does not follow an assistant message with tool calls, a tool without a
// name or with parameters that are not JSON. Messages are numbered from 0 in the errors.
absl::StatusOr<std::string> RenderChat(ChatFormat format, const Chat& chat);

// The chat of a base model that never saw chat markup (the embedded glm5_nano, trained on
// Python sources only; the router's --chat_format=plain): the messages' contents in order,
// each ending in a newline, and nothing else (no roles, special tokens or reasoning block),
// so the model continues the text and all of its output is content. Besides RenderChat's
// refusals, INVALID_ARGUMENT naming what plain text cannot carry: tools, tool calls, tool
// messages, reasoning_content, enable_thinking = true.
absl::StatusOr<std::string> RenderPlainChat(const Chat& chat);

// Whether the rendered prompt ends inside a reasoning block, so that the model's output
// starts with reasoning (GLM with the generation prompt and thinking not disabled:
// "<|assistant|><think>"). Feeds ParseOptions::starts_in_reasoning.
bool GenerationOpensReasoning(ChatFormat format, const Chat& chat);

}  // namespace nq::chat
