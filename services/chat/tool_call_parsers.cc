#include "services/chat/tool_call_parsers.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "services/chat/py_text.h"

namespace nq::chat::internal {
namespace {

constexpr absl::string_view kArgKeyOpen = "<arg_key>";
constexpr absl::string_view kArgKeyClose = "</arg_key>";
constexpr absl::string_view kArgValueOpen = "<arg_value>";
constexpr absl::string_view kArgValueClose = "</arg_value>";
constexpr absl::string_view kToolCallBegin = "<｜tool▁call▁begin｜>";
constexpr absl::string_view kToolCallEnd = "<｜tool▁call▁end｜>";
constexpr absl::string_view kToolSep = "<｜tool▁sep｜>";
constexpr absl::string_view kJsonFenceOpen = "```json";
constexpr absl::string_view kFenceClose = "```";

size_t SkipAsciiSpace(absl::string_view s, size_t pos) {
  while (pos < s.size() && absl::ascii_isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  return pos;
}

// Whether a JSON Schema says "string" (alone, or with "null").
bool IsStringSchema(const Json& schema) {
  if (!schema.is_object() || !schema.contains("type")) return false;
  const Json& type = schema["type"];
  if (type.is_string()) return type.get_ref<const std::string&>() == "string";
  if (!type.is_array()) return false;
  bool has_string = false;
  for (const Json& t : type) {
    if (!t.is_string()) return false;
    if (t == "string") {
      has_string = true;
    } else if (t != "null") {
      return false;
    }
  }
  return has_string;
}

Json GlmValue(absl::string_view raw, bool schema_says_string) {
  if (!schema_says_string) {
    absl::StatusOr<Json> parsed = ParseJson(absl::StripAsciiWhitespace(raw));
    // A JSON string literal can only have come from a string value that held the quotes.
    if (parsed.ok() && !parsed->is_string()) return *std::move(parsed);
  }
  return Json(std::string(raw));
}

std::string CompactJson(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace

StringParameters CollectStringParameters(const std::vector<ToolDefinition>& tools) {
  StringParameters out;
  for (const ToolDefinition& tool : tools) {
    absl::StatusOr<Json> schema = ParseJson(tool.parameters_json);
    if (!schema.ok() || !schema->is_object() || !schema->contains("properties")) continue;
    const Json& properties = (*schema)["properties"];
    if (!properties.is_object()) continue;
    for (auto it = properties.begin(); it != properties.end(); ++it) {
      if (IsStringSchema(it.value())) out[tool.name].insert(it.key());
    }
  }
  return out;
}

std::optional<ToolCall> ParseGlmToolCall(absl::string_view body, const StringParameters& strings) {
  size_t pos = body.find(kArgKeyOpen);
  const absl::string_view name = absl::StripAsciiWhitespace(
      body.substr(0, pos == absl::string_view::npos ? body.size() : pos));
  if (name.empty() || absl::StrContains(name, "<") || absl::StrContains(name, ">")) {
    return std::nullopt;
  }
  const auto tool_strings = strings.find(std::string(name));
  Json args = Json::object();
  while (pos != absl::string_view::npos) {
    pos = SkipAsciiSpace(body, pos);
    if (pos == body.size()) break;
    if (!absl::StartsWith(body.substr(pos), kArgKeyOpen)) return std::nullopt;
    pos += kArgKeyOpen.size();
    const size_t key_end = body.find(kArgKeyClose, pos);
    if (key_end == absl::string_view::npos) return std::nullopt;
    const std::string key(absl::StripAsciiWhitespace(body.substr(pos, key_end - pos)));
    pos = SkipAsciiSpace(body, key_end + kArgKeyClose.size());
    if (key.empty() || !absl::StartsWith(body.substr(pos), kArgValueOpen)) return std::nullopt;
    pos += kArgValueOpen.size();
    const size_t value_end = body.find(kArgValueClose, pos);
    if (value_end == absl::string_view::npos) return std::nullopt;
    const bool is_string = tool_strings != strings.end() && tool_strings->second.contains(key);
    args[key] = GlmValue(body.substr(pos, value_end - pos), is_string);
    pos = value_end + kArgValueClose.size();
  }
  return ToolCall{"", std::string(name), CompactJson(args)};
}

std::optional<std::vector<ToolCall>> ParseDeepSeekV3ToolCalls(absl::string_view body) {
  std::vector<ToolCall> calls;
  size_t pos = 0;
  while (true) {
    pos = SkipAsciiSpace(body, pos);
    if (pos == body.size()) break;
    if (!absl::StartsWith(body.substr(pos), kToolCallBegin)) return std::nullopt;
    pos += kToolCallBegin.size();
    const size_t sep = body.find(kToolSep, pos);
    const size_t end = body.find(kToolCallEnd, pos);
    if (sep == absl::string_view::npos || end == absl::string_view::npos || sep > end) {
      return std::nullopt;
    }
    const absl::string_view inner = body.substr(sep + kToolSep.size(), end - sep - kToolSep.size());
    pos = end + kToolCallEnd.size();
    const size_t newline = inner.find('\n');
    if (newline == absl::string_view::npos) return std::nullopt;
    const absl::string_view name = absl::StripAsciiWhitespace(inner.substr(0, newline));
    absl::string_view fenced = absl::StripAsciiWhitespace(inner.substr(newline + 1));
    if (name.empty() || !absl::ConsumePrefix(&fenced, kJsonFenceOpen) ||
        !absl::ConsumeSuffix(&fenced, kFenceClose)) {
      return std::nullopt;
    }
    const absl::string_view arguments = absl::StripAsciiWhitespace(fenced);
    absl::StatusOr<Json> parsed = ParseJson(arguments);
    if (!parsed.ok() || !parsed->is_object()) return std::nullopt;
    calls.push_back(ToolCall{"", std::string(name), std::string(arguments)});
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

}  // namespace nq::chat::internal
