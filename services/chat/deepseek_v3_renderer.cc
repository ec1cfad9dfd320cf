// scripts/chat/templates/deepseek_v3.jinja as code, quirks included, because the model was
// served (and its prompts cached) with exactly this text:
//   - all system messages, wherever they are, join with "\n\n" right after BOS;
//   - tool calls render only for an assistant message whose content is None (chat.h: tool
//     calls with empty content); with content, the calls are dropped;
//   - the first call of the whole conversation opens "<｜Assistant｜><｜tool▁calls▁begin｜>"
//     and is never closed on its own; every later call (in that message or any later one)
//     starts with "\n" and is followed by "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>";
//   - only the conversation's first tool result opens "<｜tool▁outputs▁begin｜>"; later ones
//     start with "\n";
//   - an assistant answer right after tool results continues the outputs block instead of
//     opening "<｜Assistant｜>"; the generation prompt is left out after tool results.
// The template ignores `tools`, reasoning_content, tool_call_id and enable_thinking.
#include <string>

#include "absl/strings/str_cat.h"
#include "services/chat/chat.h"
#include "services/chat/renderers.h"

namespace nq::chat::internal {
namespace {

constexpr char kBos[] = "<｜begin▁of▁sentence｜>";
constexpr char kEos[] = "<｜end▁of▁sentence｜>";
constexpr char kUser[] = "<｜User｜>";
constexpr char kAssistant[] = "<｜Assistant｜>";
constexpr char kToolCallsBegin[] = "<｜tool▁calls▁begin｜>";
constexpr char kToolCallsEnd[] = "<｜tool▁calls▁end｜>";
constexpr char kToolCallBegin[] = "<｜tool▁call▁begin｜>";
constexpr char kToolCallEnd[] = "<｜tool▁call▁end｜>";
constexpr char kToolSep[] = "<｜tool▁sep｜>";
constexpr char kToolOutputsBegin[] = "<｜tool▁outputs▁begin｜>";
constexpr char kToolOutputsEnd[] = "<｜tool▁outputs▁end｜>";
constexpr char kToolOutputBegin[] = "<｜tool▁output▁begin｜>";
constexpr char kToolOutputEnd[] = "<｜tool▁output▁end｜>";

// "function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>" (the template's
// tool['type'] is always "function" here).
void AppendCallBody(const ToolCall& call, std::string& out) {
  absl::StrAppend(&out, "function", kToolSep, call.name, "\n```json\n", call.arguments_json,
                  "\n```", kToolCallEnd);
}

}  // namespace

std::string RenderDeepSeekV3(const Chat& chat) {
  std::string system_prompt;
  bool first_system = true;
  for (const ChatMessage& m : chat.messages) {
    if (m.role != "system") continue;
    if (!first_system) system_prompt += "\n\n";
    system_prompt += m.content;
    first_system = false;
  }
  std::string out = absl::StrCat(kBos, system_prompt);

  // The template's namespace(is_first, is_tool, is_output_first): none is reset per message.
  bool is_first = false;
  bool is_tool = false;
  bool is_output_first = true;
  for (const ChatMessage& m : chat.messages) {
    const bool content_is_none =
        m.role == "assistant" && !m.tool_calls.empty() && m.content.empty();
    if (m.role == "user") {
      is_tool = false;
      absl::StrAppend(&out, kUser, m.content);
    } else if (m.role == "assistant" && content_is_none) {
      is_tool = false;
      for (const ToolCall& call : m.tool_calls) {
        if (!is_first) {
          absl::StrAppend(&out, kAssistant, kToolCallsBegin, kToolCallBegin);
          AppendCallBody(call, out);
          is_first = true;
        } else {
          absl::StrAppend(&out, "\n", kToolCallBegin);
          AppendCallBody(call, out);
          absl::StrAppend(&out, kToolCallsEnd, kEos);
        }
      }
    } else if (m.role == "assistant") {
      if (is_tool) {
        absl::StrAppend(&out, kToolOutputsEnd, m.content, kEos);
        is_tool = false;
      } else {
        absl::StrAppend(&out, kAssistant, m.content, kEos);
      }
    } else if (m.role == "tool") {
      is_tool = true;
      if (is_output_first) {
        absl::StrAppend(&out, kToolOutputsBegin, kToolOutputBegin, m.content, kToolOutputEnd);
        is_output_first = false;
      } else {
        absl::StrAppend(&out, "\n", kToolOutputBegin, m.content, kToolOutputEnd);
      }
    }
  }
  if (is_tool) out += kToolOutputsEnd;
  if (chat.add_generation_prompt && !is_tool) out += kAssistant;
  return out;
}

}  // namespace nq::chat::internal
