#include "services/router/openai_request.h"

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::router {
namespace {

using Json = nlohmann::json;

// OpenAI allows up to 4 stop sequences.
constexpr size_t kMaxStopStrings = 4;

absl::Status Invalid(const std::string& field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat("'", field, "' ", rule));
}

absl::StatusOr<Json> ParseBody(const std::string& body) {
  Json json = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError("the request body is not valid JSON");
  if (!json.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  return json;
}

absl::StatusOr<double> Number(const Json& json, const char* field, double lo, double hi) {
  const Json& v = json[field];
  if (!v.is_number()) return Invalid(field, "must be a number");
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) return Invalid(field, absl::StrCat("must be in [", lo, ", ", hi, "]"));
  return d;
}

absl::StatusOr<int64_t> Integer(const Json& json, const char* field, int64_t lo, int64_t hi) {
  const Json& v = json[field];
  if (!v.is_number_integer()) return Invalid(field, "must be an integer");
  const int64_t i = v.get<int64_t>();
  if (i < lo || i > hi) return Invalid(field, absl::StrCat("must be in [", lo, ", ", hi, "]"));
  return i;
}

bool Has(const Json& json, const char* field) { return json.contains(field) && !json[field].is_null(); }

// json[field] when it is a string, else `fallback` (never throws, unlike Json::value).
std::string StringOr(const Json& json, const char* field, const std::string& fallback) {
  return json.contains(field) && json[field].is_string() ? json[field].get<std::string>() : fallback;
}

absl::Status Unsupported(const std::string& field, const std::string& default_value) {
  return Invalid(field, absl::StrCat("is not supported by this server; omit it or send ", default_value));
}

// OpenAI's penalties and logit_bias, applied by the worker's sampler (SamplingParams).
absl::Status ParsePenalties(const Json& json, nq::v1::SamplingParams* s) {
  if (Has(json, "presence_penalty")) {
    ASSIGN_OR_RETURN(double penalty, Number(json, "presence_penalty", -2, 2));  // OpenAI's range
    s->set_presence_penalty(static_cast<float>(penalty));
  }
  if (Has(json, "frequency_penalty")) {
    ASSIGN_OR_RETURN(double penalty, Number(json, "frequency_penalty", -2, 2));
    s->set_frequency_penalty(static_cast<float>(penalty));
  }
  if (Has(json, "logit_bias")) {
    const Json& bias = json["logit_bias"];
    if (!bias.is_object()) return Invalid("logit_bias", "must be an object mapping token ids to biases");
    for (const auto& [key, value] : bias.items()) {
      // OpenAI sends the ids as JSON object keys, i.e. decimal strings.
      const std::string field = absl::StrCat("logit_bias[\"", key, "\"]");
      if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos ||
          std::stoull(key) > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
        return Invalid(field, "must be keyed by a token id (a non-negative integer)");
      }
      const auto id = static_cast<uint32_t>(std::stoull(key));
      if (!value.is_number()) return Invalid(field, "must be a number");
      const double b = value.get<double>();
      if (!std::isfinite(b) || b < -100 || b > 100) return Invalid(field, "must be in [-100, 100]");
      (*s->mutable_logit_bias())[id] = static_cast<float>(b);
    }
  }
  return absl::OkStatus();
}

// OpenAI fields this server does not implement: their defaults are accepted (clients such
// as the official SDKs may send them), anything else is refused rather than ignored.
absl::Status RefuseUnimplemented(const Json& json) {
  if (Has(json, "response_format")) {
    const Json& format = json["response_format"];
    if (!format.is_object() || !format.contains("type") || !format["type"].is_string()) {
      return Invalid("response_format", "must be an object with a string 'type'");
    }
    if (format["type"] != "text") return Unsupported("response_format", "{\"type\": \"text\"}");
  }
  return absl::OkStatus();
}

// The fields both endpoints share.
absl::Status ParseCommon(const Json& json, OpenAiRequest* out) {
  if (!Has(json, "model")) return Invalid("model", "is required");
  if (!json["model"].is_string()) return Invalid("model", "must be a string");
  out->model = json["model"].get<std::string>();
  nq::v1::SamplingParams& s = out->sampling;
  if (Has(json, "temperature")) {
    ASSIGN_OR_RETURN(double t, Number(json, "temperature", 0, 2));
    s.set_temperature(static_cast<float>(t));
  }
  if (Has(json, "top_p")) {
    ASSIGN_OR_RETURN(double p, Number(json, "top_p", 0, 1));
    if (p == 0) return Invalid("top_p", "must be greater than 0");
    s.set_top_p(static_cast<float>(p));
  }
  if (Has(json, "top_k")) {
    // -1 and 0 disable top-k (vLLM accepts -1).
    ASSIGN_OR_RETURN(int64_t k, Integer(json, "top_k", -1, std::numeric_limits<int32_t>::max()));
    s.set_top_k(k > 0 ? static_cast<uint32_t>(k) : 0);
  }
  if (Has(json, "seed")) {
    ASSIGN_OR_RETURN(int64_t seed, Integer(json, "seed", std::numeric_limits<int64_t>::min(),
                                           std::numeric_limits<int64_t>::max()));
    s.set_seed(static_cast<uint64_t>(seed));
  }
  for (const char* field : {"max_tokens", "max_completion_tokens"}) {
    if (!Has(json, field)) continue;
    ASSIGN_OR_RETURN(int64_t n, Integer(json, field, 1, std::numeric_limits<uint32_t>::max()));
    s.set_max_tokens(static_cast<uint32_t>(n));
  }
  if (Has(json, "stop")) {
    const Json& stop = json["stop"];
    if (stop.is_string()) {
      s.add_stop(stop.get<std::string>());
    } else if (stop.is_array()) {
      if (stop.size() > kMaxStopStrings) return Invalid("stop", absl::StrCat("may hold at most ", kMaxStopStrings, " strings"));
      for (const Json& item : stop) {
        if (!item.is_string()) return Invalid("stop", "must be a string or an array of strings");
        s.add_stop(item.get<std::string>());
      }
    } else {
      return Invalid("stop", "must be a string or an array of strings");
    }
  }
  if (Has(json, "stop_token_ids")) {
    if (!json["stop_token_ids"].is_array()) return Invalid("stop_token_ids", "must be an array of integers");
    for (const Json& id : json["stop_token_ids"]) {
      if (!id.is_number_unsigned()) return Invalid("stop_token_ids", "must be an array of non-negative integers");
      s.add_stop_token_ids(id.get<uint32_t>());
    }
  }
  if (Has(json, "ignore_eos")) {
    if (!json["ignore_eos"].is_boolean()) return Invalid("ignore_eos", "must be a boolean");
    s.set_ignore_eos(json["ignore_eos"].get<bool>());
  }
  if (Has(json, "n")) {
    ASSIGN_OR_RETURN(int64_t n, Integer(json, "n", 1, 1));
    (void)n;
  }
  RETURN_IF_ERROR(ParsePenalties(json, &s));
  RETURN_IF_ERROR(RefuseUnimplemented(json));
  if (Has(json, "stream")) {
    if (!json["stream"].is_boolean()) return Invalid("stream", "must be a boolean");
    out->stream = json["stream"].get<bool>();
  }
  if (Has(json, "stream_options")) {
    const Json& options = json["stream_options"];
    if (!options.is_object()) return Invalid("stream_options", "must be an object");
    if (Has(options, "include_usage")) {
      if (!options["include_usage"].is_boolean()) return Invalid("stream_options.include_usage", "must be a boolean");
      out->include_usage = options["include_usage"].get<bool>();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ContentText(const Json& content, const std::string& field) {
  if (content.is_null()) return std::string();
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {
    // [{"type": "text", "text": "..."}]: text parts are concatenated; other parts are refused.
    std::string text;
    for (const Json& part : content) {
      if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        return Invalid(field, "parts must be {\"type\": \"text\", \"text\": string} (this model reads text only)");
      }
      text += part["text"].get<std::string>();
    }
    return text;
  }
  return Invalid(field, "must be a string or an array of text parts");
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseCompletionRequest(const std::string& body) {
  ASSIGN_OR_RETURN(Json json, ParseBody(body));
  OpenAiRequest out;
  RETURN_IF_ERROR(ParseCommon(json, &out));
  if (!Has(json, "prompt")) return Invalid("prompt", "is required");
  const Json& prompt = json["prompt"];
  if (prompt.is_string()) {
    out.prompt_text = prompt.get<std::string>();
  } else if (prompt.is_array() && !prompt.empty() && prompt[0].is_number_integer()) {
    for (const Json& id : prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return Invalid("prompt", "token ids must be non-negative integers");
      }
      out.prompt_ids.push_back(id.get<int32_t>());
    }
  } else if (prompt.is_array() && prompt.size() == 1 && prompt[0].is_string()) {
    out.prompt_text = prompt[0].get<std::string>();
  } else if (prompt.is_array() && prompt.size() > 1) {
    return Invalid("prompt", "batches are not supported: send one prompt per request");
  } else {
    return Invalid("prompt", "must be a string or an array of token ids");
  }
  // OpenAI's legacy `logprobs`: the number of alternatives per token (OpenAI allows 5; the
  // worker reports up to 20, as chat's top_logprobs). Present, the sampled tokens' logprobs are
  // returned even for 0.
  if (Has(json, "logprobs")) {
    ASSIGN_OR_RETURN(int64_t n, Integer(json, "logprobs", 0, 20));
    out.logprobs = {.enabled = true, .top = static_cast<int>(n)};
    out.sampling.set_top_logprobs(static_cast<uint32_t>(n));
  }
  // Unrequested logprobs are not computed: greedy decoding then skips a softmax over the vocabulary.
  out.sampling.set_logprobs(out.logprobs.enabled);
  if (Has(json, "echo") && json["echo"].is_boolean() && json["echo"].get<bool>()) {
    return Invalid("echo", "is not supported");
  }
  return out;
}

absl::StatusOr<OpenAiRequest> ParseChatRequest(const std::string& body) {
  ASSIGN_OR_RETURN(Json json, ParseBody(body));
  OpenAiRequest out;
  out.chat = true;
  RETURN_IF_ERROR(ParseCommon(json, &out));
  if (!Has(json, "messages")) return Invalid("messages", "is required");
  const Json& messages = json["messages"];
  if (!messages.is_array() || messages.empty()) return Invalid("messages", "must be a non-empty array");
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& m = messages[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return Invalid(field, "must be an object");
    if (!m.contains("role") || !m["role"].is_string()) return Invalid(field + ".role", "must be a string");
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "developer") {
      return Invalid(field + ".role", "must be system, user, assistant or tool");
    }
    nq::v1::ChatMessage* message = out.chat_input.add_messages();
    message->set_role(role == "developer" ? "system" : role);
    ASSIGN_OR_RETURN(std::string content, ContentText(m.value("content", Json()), field + ".content"));
    message->set_content(std::move(content));
    for (const char* key : {"reasoning_content", "tool_call_id", "name"}) {
      if (!Has(m, key)) continue;
      if (!m[key].is_string()) return Invalid(absl::StrCat(field, ".", key), "must be a string");
      const std::string value = m[key].get<std::string>();
      if (std::string(key) == "reasoning_content") message->set_reasoning_content(value);
      if (std::string(key) == "tool_call_id") message->set_tool_call_id(value);
      if (std::string(key) == "name") message->set_name(value);
    }
    if (Has(m, "tool_calls")) {
      if (!m["tool_calls"].is_array()) return Invalid(field + ".tool_calls", "must be an array");
      for (const Json& call : m["tool_calls"]) {
        if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
            !call["function"].contains("name") || !call["function"]["name"].is_string()) {
          return Invalid(field + ".tool_calls", "entries must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}");
        }
        nq::v1::ToolCall* tc = message->add_tool_calls();
        tc->set_id(StringOr(call, "id", ""));
        tc->set_name(call["function"]["name"].get<std::string>());
        const Json& args = call["function"].value("arguments", Json("{}"));
        tc->set_arguments_json(args.is_string() ? args.get<std::string>() : args.dump());
      }
    }
  }
  if (Has(json, "tools")) {
    if (!json["tools"].is_array()) return Invalid("tools", "must be an array");
    for (const Json& tool : json["tools"]) {
      if (!tool.is_object() || !tool.contains("function") || !tool["function"].is_object() ||
          !tool["function"].contains("name") || !tool["function"]["name"].is_string()) {
        return Invalid("tools", "entries must be {\"type\": \"function\", \"function\": {\"name\", ...}}");
      }
      nq::v1::ToolDefinition* def = out.chat_input.add_tools();
      def->set_name(tool["function"]["name"].get<std::string>());
      def->set_description(StringOr(tool["function"], "description", ""));
      def->set_parameters_json(tool["function"].value("parameters", Json::object()).dump());
    }
  }
  out.chat_input.set_add_generation_prompt(true);
  if (Has(json, "chat_template_kwargs") && json["chat_template_kwargs"].is_object()) {
    const Json& kwargs = json["chat_template_kwargs"];
    if (Has(kwargs, "enable_thinking")) {
      if (!kwargs["enable_thinking"].is_boolean()) return Invalid("chat_template_kwargs.enable_thinking", "must be a boolean");
      out.chat_input.set_enable_thinking(kwargs["enable_thinking"].get<bool>());
    }
  }
  // Chat: `logprobs: true` returns each token's logprob, `top_logprobs` (0..20) the
  // alternatives, which OpenAI only accepts together with `logprobs: true` (0, the default
  // that SDKs may send, is accepted alone).
  if (Has(json, "logprobs")) {
    if (!json["logprobs"].is_boolean()) return Invalid("logprobs", "must be a boolean");
    out.logprobs.enabled = json["logprobs"].get<bool>();
  }
  if (Has(json, "top_logprobs")) {
    ASSIGN_OR_RETURN(int64_t n, Integer(json, "top_logprobs", 0, 20));
    if (n > 0 && !out.logprobs.enabled) return Invalid("top_logprobs", "requires 'logprobs': true");
    out.logprobs.top = static_cast<int>(n);
    out.sampling.set_top_logprobs(static_cast<uint32_t>(n));
  }
  out.sampling.set_logprobs(out.logprobs.enabled);  // as for completions
  return out;
}

}  // namespace nq::router
