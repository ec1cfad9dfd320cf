#include "services/nvfp4/utf8_probe.h"

#include <httplib.h>

#include <algorithm>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace nq::nvfp4 {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxExamples = 8;
constexpr size_t kExampleBytes = 160;

// "http[s]://host[:port][/v1][/]" -> "http[s]://host[:port]", what httplib::Client takes.
absl::StatusOr<std::string> ServerRoot(absl::string_view url) {
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, "http://") && !absl::ConsumePrefix(&rest, "https://")) {
    return absl::InvalidArgumentError(absl::StrCat("--url: want http://host:port or https://..., got '", url, "'"));
  }
  const size_t slash = rest.find('/');
  absl::string_view path = slash == absl::string_view::npos ? "" : rest.substr(slash);
  while (absl::ConsumeSuffix(&path, "/")) {
  }
  if (!path.empty() && path != "/v1") {
    return absl::InvalidArgumentError(absl::StrCat("--url: give the server root (optionally /v1), not '", path, "'"));
  }
  if (slash == 0 || rest.empty()) return absl::InvalidArgumentError("--url: no host");
  return std::string(url.substr(0, url.size() - rest.size() + std::min(slash, rest.size())));
}

// What one response said, gathered from a JSON body or an SSE stream.
struct Output {
  std::string content;
  std::string reasoning;
  std::map<int, std::string> tool_arguments;  // by tool-call index
};

std::string StringOr(const Json& object, const char* key) {
  return object.is_object() && object.contains(key) && object[key].is_string() ? object[key].get<std::string>() : "";
}

// Adds a message (non-streaming) or a delta (streaming) to `out`. Streaming arguments arrive in
// pieces and are concatenated per index, as OpenAI clients do.
void Accumulate(const Json& message, Output& out) {
  out.content += StringOr(message, "content");
  out.reasoning += StringOr(message, "reasoning_content");
  if (!message.is_object() || !message.contains("tool_calls") || !message["tool_calls"].is_array()) return;
  int position = 0;
  for (const Json& call : message["tool_calls"]) {
    const int index = call.contains("index") && call["index"].is_number_integer() ? call["index"].get<int>() : position;
    ++position;
    if (call.contains("function")) out.tool_arguments[index] += StringOr(call["function"], "arguments");
  }
}

// Adds choice[key] (key: "message" or "delta"); false when the choice is not an object.
// (json::value() would throw on a non-object, and no exception may leave this file.)
bool AccumulateChoice(const Json& choice, const char* key, Output& out) {
  if (!choice.is_object()) return false;
  if (choice.contains(key)) Accumulate(choice[key], out);
  return true;
}

// Parses a response body into `out`; false when it is not what an OpenAI server sends.
bool ParseBody(const std::string& body, bool stream, Output& out) {
  if (!stream) {
    const Json json = Json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded() || !json.contains("choices") || !json["choices"].is_array() || json["choices"].empty()) {
      return false;
    }
    return AccumulateChoice(json["choices"][0], "message", out);
  }
  bool any = false;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    line = absl::StripTrailingAsciiWhitespace(line);
    if (!absl::ConsumePrefix(&line, "data:")) continue;
    line = absl::StripLeadingAsciiWhitespace(line);
    if (line == "[DONE]") continue;
    const Json event = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (event.is_discarded()) return false;
    if (event.contains("choices") && event["choices"].is_array() && !event["choices"].empty()) {
      if (!AccumulateChoice(event["choices"][0], "delta", out)) return false;
      any = true;
    }
  }
  return any;
}

void Judge(const Output& out, LanguageTally& tally, std::vector<std::string>& examples) {
  int64_t fffd = CountReplacementChars(out.content) + CountReplacementChars(out.reasoning);
  int64_t malformed = 0;
  for (const auto& [index, arguments] : out.tool_arguments) {
    fffd += CountReplacementChars(arguments);
    const Json parsed = Json::parse(arguments, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !parsed.is_object()) {
      ++malformed;
    } else {
      ++tally.tool_calls;
    }
  }
  // Tool-call markup the server failed to parse into tool_calls is a broken call too.
  if (out.tool_arguments.empty() && absl::StrContains(out.content, "<tool_call>")) ++malformed;
  const bool empty = absl::StripAsciiWhitespace(out.content).empty() &&
                     absl::StripAsciiWhitespace(out.reasoning).empty() && out.tool_arguments.empty();
  tally.replacement_chars += fffd;
  tally.malformed_tool_calls += malformed;
  tally.empty_outputs += empty ? 1 : 0;
  if ((fffd > 0 || malformed > 0 || empty) && examples.size() < kMaxExamples) {
    std::string text = out.content;
    if (!out.reasoning.empty()) absl::StrAppend(&text, " [reasoning] ", out.reasoning);
    for (const auto& [index, arguments] : out.tool_arguments) absl::StrAppend(&text, " [tool ", index, "] ", arguments);
    if (text.size() > kExampleBytes) {
      // Cut on a character boundary so the example stays printable UTF-8.
      size_t cut = kExampleBytes;
      while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
      text.resize(cut);
    }
    examples.push_back(absl::StrCat(tally.language, ": ", empty ? "(empty)" : text));
  }
}

httplib::Headers AuthHeaders(const ProbeOptions& options) {
  httplib::Headers headers;
  if (!options.api_key.empty()) headers.emplace("Authorization", "Bearer " + options.api_key);
  return headers;
}

absl::StatusOr<std::string> FirstModel(httplib::Client& client, const ProbeOptions& options) {
  httplib::Result result = client.Get("/v1/models", AuthHeaders(options));
  if (!result) return absl::UnavailableError(absl::StrCat("GET /v1/models: ", httplib::to_string(result.error())));
  if (result->status != 200) return absl::UnavailableError(absl::StrCat("GET /v1/models: HTTP ", result->status));
  const Json json = Json::parse(result->body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.contains("data") || !json["data"].is_array() || json["data"].empty() ||
      !json["data"][0].contains("id") || !json["data"][0]["id"].is_string()) {
    return absl::UnavailableError("GET /v1/models: no model id in the answer; pass --probe-model");
  }
  return json["data"][0]["id"].get<std::string>();
}

}  // namespace

bool IsValidUtf8(absl::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(bytes[k]); };
    const unsigned char b0 = byte(i);
    int length;
    uint32_t code;
    if (b0 < 0x80) {
      ++i;
      continue;
    } else if ((b0 & 0xE0) == 0xC0) {
      length = 2;
      code = b0 & 0x1F;
    } else if ((b0 & 0xF0) == 0xE0) {
      length = 3;
      code = b0 & 0x0F;
    } else if ((b0 & 0xF8) == 0xF0) {
      length = 4;
      code = b0 & 0x07;
    } else {
      return false;
    }
    if (i + length > bytes.size()) return false;
    for (int k = 1; k < length; ++k) {
      if ((byte(i + k) & 0xC0) != 0x80) return false;
      code = (code << 6) | (byte(i + k) & 0x3F);
    }
    static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < kMinForLength[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    i += length;
  }
  return true;
}

int64_t CountReplacementChars(absl::string_view text) {
  int64_t count = 0;
  for (size_t pos = text.find("\xEF\xBF\xBD"); pos != absl::string_view::npos; pos = text.find("\xEF\xBF\xBD", pos + 3)) {
    ++count;
  }
  return count;
}

bool ProbeReport::Clean() const {
  for (const LanguageTally& t : languages) {
    if (t.Corrupt() > 0 || t.failed_requests > 0) return false;
  }
  return !languages.empty();
}

absl::StatusOr<ProbeReport> RunUtf8Probe(const ProbeOptions& options) {
  if (options.runs < 1) return absl::InvalidArgumentError(absl::StrCat("--runs must be >= 1, got ", options.runs));
  if (options.prompts.empty()) return absl::InvalidArgumentError("no prompts");
  absl::StatusOr<std::string> root = ServerRoot(options.url);
  if (!root.ok()) return root.status();
  httplib::Client client(*root);
  if (!client.is_valid()) return absl::InvalidArgumentError(absl::StrCat("--url: cannot use '", options.url, "'"));
  client.set_connection_timeout(10);
  client.set_read_timeout(options.timeout_s);
  client.set_write_timeout(options.timeout_s);

  ProbeReport report;
  report.model = options.model;
  if (report.model.empty()) {
    absl::StatusOr<std::string> model = FirstModel(client, options);
    if (!model.ok()) return model.status();
    report.model = *model;
  }
  std::map<std::string, size_t> index;
  for (const ProbePrompt& prompt : options.prompts) {
    if (index.emplace(prompt.language, report.languages.size()).second) {
      report.languages.push_back(LanguageTally{prompt.language});
    }
  }
  for (int run = 0; run < options.runs; ++run) {
    for (const ProbePrompt& prompt : options.prompts) {
      LanguageTally& tally = report.languages[index[prompt.language]];
      ++tally.requests;
      Json request = {{"model", report.model},
                      {"messages", Json::array({{{"role", "user"}, {"content", prompt.text}}})},
                      {"max_tokens", options.max_tokens},
                      {"temperature", options.temperature},
                      {"stream", options.stream}};
      if (prompt.tool_call) request["tools"] = ProbeTools();
      httplib::Result result =
          client.Post("/v1/chat/completions", AuthHeaders(options), request.dump(), "application/json");
      if (!result || result->status != 200) {
        ++tally.failed_requests;
        if (report.examples.size() < kMaxExamples) {
          report.examples.push_back(absl::StrCat(prompt.language, ": request failed: ",
                                                 result ? absl::StrCat("HTTP ", result->status)
                                                        : httplib::to_string(result.error())));
        }
        continue;
      }
      if (!IsValidUtf8(result->body)) {
        ++tally.invalid_utf8;
        continue;
      }
      Output output;
      if (!ParseBody(result->body, options.stream, output)) {
        ++tally.failed_requests;
        continue;
      }
      Judge(output, tally, report.examples);
    }
  }
  return report;
}

Json ProbeJson(const ProbeReport& report) {
  Json languages = Json::array();
  for (const LanguageTally& t : report.languages) {
    languages.push_back({{"language", t.language},
                         {"requests", t.requests},
                         {"replacement_chars", t.replacement_chars},
                         {"invalid_utf8", t.invalid_utf8},
                         {"malformed_tool_calls", t.malformed_tool_calls},
                         {"empty_outputs", t.empty_outputs},
                         {"failed_requests", t.failed_requests},
                         {"tool_calls", t.tool_calls}});
  }
  return {{"model", report.model}, {"clean", report.Clean()}, {"languages", languages}, {"examples", report.examples}};
}

std::string ProbeText(const ProbeReport& report) {
  std::string out = absl::StrFormat("model %s\n%-15s %8s %7s %8s %10s %6s %7s %6s\n", report.model, "language",
                                    "requests", "U+FFFD", "bad-utf8", "bad-tool", "empty", "failed", "tools");
  for (const LanguageTally& t : report.languages) {
    absl::StrAppendFormat(&out, "%-15s %8d %7d %8d %10d %6d %7d %6d\n", t.language, t.requests, t.replacement_chars,
                          t.invalid_utf8, t.malformed_tool_calls, t.empty_outputs, t.failed_requests, t.tool_calls);
  }
  for (const std::string& e : report.examples) absl::StrAppend(&out, "  e.g. ", e, "\n");
  absl::StrAppend(&out, report.Clean() ? "clean\n" : "CORRUPTION or failed requests found\n");
  return out;
}

}  // namespace nq::nvfp4
