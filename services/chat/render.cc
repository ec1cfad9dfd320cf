#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/chat/chat.h"
#include "services/chat/py_text.h"
#include "services/chat/renderers.h"
#include "services/common/status_macros.h"

namespace nq::chat {
namespace {

bool IsKnownRole(absl::string_view role) {
  return role == "system" || role == "user" || role == "assistant" || role == "tool";
}

absl::Status MessageError(size_t index, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("message ", index, ": ", what));
}

// The checks shared by every format (chat.h lists them). Format-specific failures (GLM's
// arguments that must be JSON objects) come from the renderers.
absl::Status ValidateChat(const Chat& chat) {
  bool tool_results_allowed = false;  // inside the run of results after an assistant's calls
  for (size_t i = 0; i < chat.messages.size(); ++i) {
    const ChatMessage& m = chat.messages[i];
    if (!IsKnownRole(m.role)) {
      return MessageError(i, absl::StrCat("unknown role \"", m.role,
                                          "\" (expected system, user, assistant or tool)"));
    }
    const bool assistant = m.role == "assistant";
    if (!assistant && !m.tool_calls.empty()) {
      return MessageError(i, absl::StrCat("tool_calls on a \"", m.role, "\" message"));
    }
    if (!assistant && !m.reasoning_content.empty()) {
      return MessageError(i, absl::StrCat("reasoning_content on a \"", m.role, "\" message"));
    }
    for (size_t c = 0; c < m.tool_calls.size(); ++c) {
      if (m.tool_calls[c].name.empty()) {
        return MessageError(i, absl::StrCat("tool call ", c, " has no name"));
      }
    }
    if (m.role == "tool") {
      if (!tool_results_allowed) {
        return MessageError(i, "tool message without a preceding assistant tool call");
      }
    } else {
      tool_results_allowed = assistant && !m.tool_calls.empty();
    }
  }
  for (size_t t = 0; t < chat.tools.size(); ++t) {
    const ToolDefinition& tool = chat.tools[t];
    if (tool.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tool ", t, " has no name"));
    }
    if (!tool.parameters_json.empty()) {
      absl::StatusOr<Json> parameters = ParseJson(tool.parameters_json);
      if (!parameters.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tool \"", tool.name,
                         "\": parameters are not valid JSON: ", parameters.status().message()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view ChatFormatName(ChatFormat format) {
  switch (format) {
    case ChatFormat::kGlm5: return "glm5";
    case ChatFormat::kDeepSeekV3: return "deepseek_v3";
  }
  return "unknown";
}

absl::StatusOr<ChatFormat> ChatFormatForArchitecture(absl::string_view architecture) {
  if (architecture == "GlmMoeDsaForCausalLM") return ChatFormat::kGlm5;
  if (architecture == "DeepseekV3ForCausalLM") return ChatFormat::kDeepSeekV3;
  return absl::NotFoundError(absl::StrCat("no chat format for architecture \"", architecture,
                                          "\" (known: GlmMoeDsaForCausalLM, "
                                          "DeepseekV3ForCausalLM)"));
}

absl::StatusOr<std::string> RenderChat(ChatFormat format, const Chat& chat) {
  RETURN_IF_ERROR(ValidateChat(chat));
  switch (format) {
    case ChatFormat::kGlm5: return internal::RenderGlm5(chat);
    case ChatFormat::kDeepSeekV3: return internal::RenderDeepSeekV3(chat);
  }
  return absl::InvalidArgumentError("unknown chat format");
}

absl::StatusOr<std::string> RenderPlainChat(const Chat& chat) {
  RETURN_IF_ERROR(ValidateChat(chat));
  if (!chat.tools.empty()) {
    return absl::InvalidArgumentError("the plain chat format has no tools (the model has no tool-call syntax)");
  }
  if (chat.enable_thinking.value_or(false)) {
    return absl::InvalidArgumentError("the plain chat format has no reasoning block: enable_thinking must not be true");
  }
  std::string text;
  for (size_t i = 0; i < chat.messages.size(); ++i) {
    const ChatMessage& m = chat.messages[i];
    if (m.role == "tool" || !m.tool_calls.empty()) {
      return MessageError(i, "the plain chat format has no tool calls or tool results");
    }
    if (!m.reasoning_content.empty()) {
      return MessageError(i, "the plain chat format has no reasoning_content");
    }
    text += m.content;
    if (!absl::EndsWith(m.content, "\n")) text += '\n';
  }
  return text;
}

bool GenerationOpensReasoning(ChatFormat format, const Chat& chat) {
  switch (format) {
    case ChatFormat::kGlm5:
      return chat.add_generation_prompt && chat.enable_thinking.value_or(true);
    case ChatFormat::kDeepSeekV3: return false;  // its template never opens a think block
  }
  return false;
}

}  // namespace nq::chat
