// Parsing one closed tool-call section of each format (the text between its open and close
// markers) into OpenAI tool calls. Internal to services/chat.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "services/chat/chat.h"

namespace nq::chat::internal {

// Parameters whose JSON Schema type is "string", by tool name (from ParseOptions::tools).
using StringParameters = absl::flat_hash_map<std::string, absl::flat_hash_set<std::string>>;
StringParameters CollectStringParameters(const std::vector<ToolDefinition>& tools);

// GLM: "NAME<arg_key>K</arg_key><arg_value>V</arg_value>..." (whitespace between the parts
// is allowed, as GLM-4.5 writes newlines there). A value is a string when the schema says so,
// else JSON when it parses as a non-string JSON value, else the raw string. nullopt when the
// body does not have that shape. The call's id is left empty.
std::optional<ToolCall> ParseGlmToolCall(absl::string_view body, const StringParameters& strings);

// DeepSeek-V3: "<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\n```json\nARGS\n```
// <｜tool▁call▁end｜>" repeated, separated by whitespace. ARGS must be a JSON object; it is
// kept as written (trimmed). nullopt when any call does not parse.
std::optional<std::vector<ToolCall>> ParseDeepSeekV3ToolCalls(absl::string_view body);

}  // namespace nq::chat::internal
