// `nq probe-utf8`: sends multilingual and tool-calling chat prompts through any
// OpenAI-compatible endpoint and counts what a broken NVFP4 repack (or a detokenizer that
// splits UTF-8 characters) does to served text: U+FFFD replacement characters, bytes that are
// not UTF-8, tool calls whose arguments are not a JSON object, tool-call markup left in the
// content, and empty outputs (an empty string proves nothing, so it never counts as clean).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::nvfp4 {

struct ProbePrompt {
  std::string language;  // "korean", "japanese", ..., "code_switching"
  std::string text;
  bool tool_call = false;  // sent with the probe's tool definition, asking for a call
};

// The built-in prompt set: Korean, Japanese, Chinese, Tamil, Arabic, Russian, Hindi, emoji and
// code-switching, each once as plain chat and once as a tool-calling request.
const std::vector<ProbePrompt>& ProbePrompts();
// The tool definition sent with tool-calling prompts (OpenAI "tools" array).
nlohmann::json ProbeTools();

struct ProbeOptions {
  std::string url;  // http[s]://host[:port] (a trailing "/v1" or "/" is accepted)
  int runs = 1;     // each prompt is sent this many times
  std::string model;  // empty: the first id of GET /v1/models
  int max_tokens = 96;
  double temperature = 0.7;  // > 0 so that runs differ
  std::string api_key;       // sent as "Authorization: Bearer" when set
  bool stream = false;       // SSE: deltas are concatenated as a client would
  int timeout_s = 300;
  std::vector<ProbePrompt> prompts = ProbePrompts();
};

struct LanguageTally {
  std::string language;
  int64_t requests = 0;
  int64_t replacement_chars = 0;  // U+FFFD in content, reasoning or tool arguments
  int64_t invalid_utf8 = 0;       // responses whose bytes are not UTF-8
  int64_t malformed_tool_calls = 0;
  int64_t empty_outputs = 0;
  int64_t failed_requests = 0;    // transport errors, HTTP errors, unparseable bodies
  int64_t tool_calls = 0;         // well-formed tool calls seen (information, not a failure)

  int64_t Corrupt() const { return replacement_chars + invalid_utf8 + malformed_tool_calls + empty_outputs; }
};

struct ProbeReport {
  std::string model;
  std::vector<LanguageTally> languages;  // in prompt order
  std::vector<std::string> examples;     // a few corrupted outputs, for the operator

  // Any corruption or failed request: the probe cannot call the endpoint clean.
  bool Clean() const;
};

// INVALID_ARGUMENT for a bad URL or runs < 1;
// UNAVAILABLE when /v1/models cannot be read and no model was given. Per-request failures are
// counted, not returned.
absl::StatusOr<ProbeReport> RunUtf8Probe(const ProbeOptions& options);

// Whether `bytes` is well-formed UTF-8 (no overlongs, surrogates or code points > U+10FFFF).
bool IsValidUtf8(absl::string_view bytes);
// Occurrences of U+FFFD (EF BF BD) in `text`.
int64_t CountReplacementChars(absl::string_view text);

nlohmann::json ProbeJson(const ProbeReport& report);
std::string ProbeText(const ProbeReport& report);

}  // namespace nq::nvfp4
