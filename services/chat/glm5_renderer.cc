// scripts/chat/templates/glm5.jinja as code. The template is rendered by transformers with
// trim_blocks and lstrip_blocks, and every tag that would leave a newline strips it, so the
// output is the concatenation below with no whitespace of its own.
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/chat/chat.h"
#include "services/chat/py_text.h"
#include "services/chat/renderers.h"
#include "services/common/status_macros.h"

namespace nq::chat::internal {
namespace {

constexpr char kToolsHeader[] =
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";
constexpr char kToolsFooter[] =
    "</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>"
    "<arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key>"
    "<arg_value>{arg-value-2}</arg_value>...</tool_call>";

// {"type": "function", "function": {...}} as chat.h's conversion rules build it.
absl::StatusOr<Json> ToolJson(const ToolDefinition& tool) {
  Json function = Json::object();
  function["name"] = tool.name;
  if (!tool.description.empty()) function["description"] = tool.description;
  if (!tool.parameters_json.empty()) {
    ASSIGN_OR_RETURN(function["parameters"], ParseJson(tool.parameters_json));
  }
  Json out = Json::object();
  out["type"] = "function";
  out["function"] = std::move(function);
  return out;
}

absl::StatusOr<Json> ArgumentsObject(const ToolCall& call, size_t message, size_t index) {
  const std::string where =
      absl::StrCat("message ", message, " tool call ", index, " (\"", call.name, "\"): ");
  if (call.arguments_json.empty()) return Json::object();
  absl::StatusOr<Json> args = ParseJson(call.arguments_json);
  if (!args.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "arguments are not valid JSON: ", args.status().message()));
  }
  // The template iterates `arguments.items()`, which only a mapping has.
  if (!args->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "arguments are not a JSON object"));
  }
  return args;
}

// The assistant branch: reasoning (kept only after the last user message), stripped content,
// then the tool calls.
absl::Status AppendAssistant(const ChatMessage& m, size_t index, int last_user_index,
                             std::string& out) {
  out += "<|assistant|>";
  std::string reasoning;
  std::string content = m.content;
  if (!m.reasoning_content.empty()) {
    reasoning = m.reasoning_content;
  } else if (absl::StrContains(content, "</think>")) {
    const std::vector<absl::string_view> parts = PySplit(content, "</think>");
    const absl::string_view before = PyRStripChars(parts.front(), "\n");
    reasoning = std::string(PyLStripChars(PySplit(before, "<think>").back(), "\n"));
    content = std::string(PyLStripChars(parts.back(), "\n"));
  }
  if (static_cast<int>(index) > last_user_index && !reasoning.empty()) {
    absl::StrAppend(&out, "<think>", PyStrip(reasoning), "</think>");
  } else {
    out += "</think>";
  }
  out += PyStrip(content);
  for (size_t c = 0; c < m.tool_calls.size(); ++c) {
    const ToolCall& call = m.tool_calls[c];
    ASSIGN_OR_RETURN(const Json args, ArgumentsObject(call, index, c));
    absl::StrAppend(&out, "<tool_call>", call.name);
    for (auto it = args.begin(); it != args.end(); ++it) {
      // Strings go in raw, everything else as tojson(ensure_ascii=False).
      absl::StrAppend(&out, "<arg_key>", it.key(), "</arg_key><arg_value>",
                      it.value().is_string() ? it.value().get_ref<const std::string&>()
                                             : PyJsonDumps(it.value()),
                      "</arg_value>");
    }
    out += "</tool_call>";
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> RenderGlm5(const Chat& chat) {
  std::string out = "[gMASK]<sop>";
  if (!chat.tools.empty()) {
    out += kToolsHeader;
    for (const ToolDefinition& tool : chat.tools) {
      ASSIGN_OR_RETURN(const Json json, ToolJson(tool));
      absl::StrAppend(&out, PyJsonDumps(json), "\n");
    }
    out += kToolsFooter;
  }
  int last_user_index = -1;
  for (size_t i = 0; i < chat.messages.size(); ++i) {
    if (chat.messages[i].role == "user") last_user_index = static_cast<int>(i);
  }
  for (size_t i = 0; i < chat.messages.size(); ++i) {
    const ChatMessage& m = chat.messages[i];
    if (m.role == "user") {
      absl::StrAppend(&out, "<|user|>", m.content);
    } else if (m.role == "assistant") {
      RETURN_IF_ERROR(AppendAssistant(m, i, last_user_index, out));
    } else if (m.role == "tool") {
      // One <|observation|> opens a run of consecutive tool results.
      if (i == 0 || chat.messages[i - 1].role != "tool") out += "<|observation|>";
      absl::StrAppend(&out, "<tool_response>", m.content, "</tool_response>");
    } else if (m.role == "system") {
      absl::StrAppend(&out, "<|system|>", m.content);
    }
  }
  if (chat.add_generation_prompt) {
    // enable_thinking=false closes the (empty) think block in the prompt itself.
    const bool thinking_off = chat.enable_thinking.has_value() && !*chat.enable_thinking;
    absl::StrAppend(&out, "<|assistant|>", thinking_off ? "</think>" : "<think>");
  }
  return out;
}

}  // namespace nq::chat::internal
