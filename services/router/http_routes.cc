#include "services/router/http_routes.h"

#include <atomic>
#include <chrono>
#include <random>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "absl/strings/str_format.h"
#include "services/common/http_peer.h"
#include "services/common/http_server.h"
#include "services/common/logging.h"
#include "services/common/metrics/registry.h"
#include "services/common/status_http.h"
#include "services/common/status_macros.h"
#include "services/router/inference_service.h"
#include "services/router/openai_logprobs.h"
#include "services/router/openai_request.h"

namespace nq::router {
namespace {

using Json = nlohmann::json;

void SendError(httplib::Response& response, const absl::Status& status) {
  HttpError error = ToHttpError(status);
  response.status = error.http_status;
  response.set_content(error.body, "application/json");
}

std::string NewId(const char* prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("%s-%016x", prefix, rng());
}

int64_t NowUnix() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const char* FinishReasonText(nq::v1::FinishReason reason) {
  switch (reason) {
    case nq::v1::FINISH_REASON_STOP: return "stop";
    case nq::v1::FINISH_REASON_LENGTH: return "length";
    case nq::v1::FINISH_REASON_TOOL_CALLS: return "tool_calls";
    case nq::v1::FINISH_REASON_ABORT: return "abort";
    default: return "error";
  }
}

Json UsageJson(const nq::v1::Usage& usage) {
  Json json = {{"prompt_tokens", usage.prompt_tokens()},
               {"completion_tokens", usage.completion_tokens()},
               {"total_tokens", usage.prompt_tokens() + usage.completion_tokens()}};
  if (usage.cached_prompt_tokens() > 0) {
    json["prompt_tokens_details"] = {{"cached_tokens", usage.cached_prompt_tokens()}};
  }
  return json;
}

// What a generation ended by the drain deadline reports instead of its usual end.
absl::Status DrainedError() {
  return absl::UnavailableError(
      "the server is shutting down: the request was ended at the drain deadline (--drain_timeout_s); retry on "
      "another replica");
}

bool DrainPassed(const HttpRoutesConfig& config) { return config.drain != nullptr && config.drain->Passed(); }

// The tokenizer's bytes for the logprobs objects (openai_logprobs.h); an id the tokenizer
// lacks (a vocabulary padded past it) reads as no text, as it streams.
TokenText TokenTextOf(const tokenizer::Tokenizer& tok) {
  auto of = [&tok](int32_t id, bool skip_special) {
    absl::StatusOr<std::string_view> bytes = tok.TokenBytes(id, skip_special);
    return bytes.ok() ? std::string(*bytes) : std::string();
  };
  return {.bytes = [of](int32_t id) { return of(id, false); }, .text_bytes = [of](int32_t id) { return of(id, true); }};
}

// A choice's `logprobs` for `tokens`: null unless the request asked for them.
Json ChoiceLogprobs(const LogprobsRequest& want, bool chat, std::span<const nq::v1::TokenLogprob> tokens,
                    const TokenText& text, CompletionLogprobs& legacy) {
  if (!want.enabled) return nullptr;
  if (chat) return {{"content", ChatLogprobContent(tokens, text)}, {"refusal", nullptr}};
  return legacy.Next(tokens);
}

std::string Sse(const Json& json) { return "data: " + json.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n"; }

// Everything a generation route needs, resolved once per request.
struct Route {
  const HttpRoutesConfig* config;
  Json error_json;

  absl::Status Authorize(const httplib::Request& request) const {
    if (config->api_key == nullptr) return absl::OkStatus();
    return config->api_key->Check(request.get_header_value("Authorization"));
  }

  absl::Status CheckModel(const std::string& model) const {
    std::optional<nq::v1::WorkerInfo> info = config->worker->info();
    const std::string served = !config->served_model_name.empty() ? config->served_model_name
                               : info.has_value()                 ? info->model_id()
                                                                  : "";
    if (!model.empty() && model != served) {
      return absl::NotFoundError("the model '" + model + "' does not exist; this server serves '" + served + "'");
    }
    return absl::OkStatus();
  }

  std::string ServedModel() const {
    std::optional<nq::v1::WorkerInfo> info = config->worker->info();
    if (!config->served_model_name.empty()) return config->served_model_name;
    return info.has_value() ? info->model_id() : "";
  }
};

// Runs the generation for one OpenAI request, streaming (SSE) or not. `chat` selects the
// chat completion shapes.
void ServeGeneration(const HttpRoutesConfig& config, const httplib::Request& http_request,
                     httplib::Response& response, bool chat) {
  Route route{&config, {}};
  if (absl::Status s = route.Authorize(http_request); !s.ok()) return SendError(response, s);
  if (config.generator == nullptr) {
    return SendError(response, absl::UnavailableError("this router has no tokenizer loaded (--tokenizer)"));
  }
  if (chat && config.chat == nullptr) {
    return SendError(response, absl::UnimplementedError("this model has no chat format configured"));
  }
  absl::StatusOr<OpenAiRequest> parsed = chat ? ParseChatRequest(http_request.body) : ParseCompletionRequest(http_request.body);
  if (!parsed.ok()) return SendError(response, parsed.status());
  if (absl::Status s = route.CheckModel(parsed->model); !s.ok()) return SendError(response, s);

  GenerationRequest request;
  request.request_id = NewId(chat ? "chatcmpl" : "cmpl");
  request.sampling = parsed->sampling;
  request.deadline = std::chrono::steady_clock::now() + config.request_timeout;
  const tokenizer::Tokenizer& tok = config.generator->tokenizer();
  if (chat) {
    absl::StatusOr<std::string> prompt = config.chat->Render(parsed->chat_input);
    if (!prompt.ok()) return SendError(response, prompt.status());
    // The chat template writes the special tokens itself.
    absl::StatusOr<std::vector<int32_t>> ids = tok.Encode(*prompt, /*add_special_tokens=*/false);
    if (!ids.ok()) return SendError(response, ids.status());
    request.prompt = *std::move(ids);
  } else if (parsed->prompt_text.has_value()) {
    absl::StatusOr<std::vector<int32_t>> ids = tok.Encode(*parsed->prompt_text, /*add_special_tokens=*/true);
    if (!ids.ok()) return SendError(response, ids.status());
    request.prompt = *std::move(ids);
  } else {
    request.prompt = parsed->prompt_ids;
  }

  const std::string id = request.request_id;
  // The client's socket, polled while the request waits in the queue and while it runs, so
  // a client that leaves frees its queue place and the worker at once.
  absl::StatusOr<HttpPeer> peer = HttpPeer::Find(http_request);
  if (!peer.ok()) {
    static LogRateLimiter limiter(std::chrono::seconds(10));
    if (long n = limiter.Allow()) {
      spdlog::warn("serving without disconnect detection ({} times): {}", n, peer.status().ToString());
    }
  }
  auto client_gone = [&peer] { return peer.ok() && peer->Gone(); };
  auto cancelled = [&] { return client_gone() || DrainPassed(config); };
  // Admission happens before any byte is sent, so a full queue is a plain 429.
  absl::StatusOr<std::unique_ptr<Generation>> started = config.generator->Start(std::move(request), cancelled);
  if (!started.ok()) {
    return SendError(response, DrainPassed(config) && absl::IsCancelled(started.status()) ? DrainedError()
                                                                                           : started.status());
  }
  std::shared_ptr<Generation> generation = *std::move(started);
  const std::string model = route.ServedModel();
  const int64_t created = NowUnix();
  std::shared_ptr<ChatStreamParser> parser;
  if (chat) parser = config.chat->NewParser(parsed->chat_input);
  const LogprobsRequest want_logprobs = parsed->logprobs;
  const TokenText token_text = TokenTextOf(tok);

  if (!parsed->stream) {
    std::string text;
    std::vector<nq::v1::TokenLogprob> tokens;
    absl::StatusOr<GenerationOutcome> outcome = generation->Run(
        [&](const GenerationDelta& delta) {
          text += delta.text;
          if (want_logprobs.enabled) tokens.insert(tokens.end(), delta.tokens.begin(), delta.tokens.end());
          return true;
        },
        cancelled);
    if (!outcome.ok()) return SendError(response, outcome.status());
    if (outcome->finish == nq::v1::FINISH_REASON_ABORT) {
      // Nobody reads a disconnected client's answer; a drained one gets the reason.
      return SendError(response, DrainPassed(config) ? DrainedError()
                                                     : absl::CancelledError("the client went away"));
    }
    CompletionLogprobs legacy(token_text, want_logprobs.top);
    Json choice = {{"index", 0}, {"finish_reason", FinishReasonText(outcome->finish)},
                   {"logprobs", ChoiceLogprobs(want_logprobs, chat, tokens, token_text, legacy)}};
    Json body = {{"id", id}, {"created", created}, {"model", model}, {"usage", UsageJson(outcome->usage)}};
    if (chat) {
      parser->Feed(text);
      parser->Finish();
      ParsedAssistant parsed_output = parser->Result();
      Json message = {{"role", "assistant"}, {"content", parsed_output.content}};
      if (!parsed_output.reasoning.empty()) message["reasoning_content"] = parsed_output.reasoning;
      if (!parsed_output.tool_calls.empty()) {
        Json calls = Json::array();
        for (const nq::v1::ToolCall& call : parsed_output.tool_calls) {
          calls.push_back({{"id", call.id()}, {"type", "function"},
                           {"function", {{"name", call.name()}, {"arguments", call.arguments_json()}}}});
        }
        message["tool_calls"] = calls;
        if (outcome->finish == nq::v1::FINISH_REASON_STOP) choice["finish_reason"] = "tool_calls";
      }
      choice["message"] = message;
      body["object"] = "chat.completion";
    } else {
      choice["text"] = text;
      body["object"] = "text_completion";
    }
    body["choices"] = Json::array({choice});
    response.set_content(body.dump(-1, ' ', false, Json::error_handler_t::replace), "application/json");
    return;
  }

  const bool include_usage = parsed->include_usage;
  response.set_header("Cache-Control", "no-cache");
  response.set_chunked_content_provider(
      "text/event-stream",
      [generation, parser, id, model, created, chat, include_usage, want_logprobs, token_text,
       config = &config](size_t, httplib::DataSink& sink) {
        // The tokens whose logprobs the next chunk carries: those of the text it brings, and
        // of text still held (by the detokenizer, stop matcher or chat parser) when a chunk
        // goes out; the last chunk carries the rest.
        std::vector<nq::v1::TokenLogprob> pending;
        CompletionLogprobs legacy(token_text, want_logprobs.top);
        auto chunk = [&](Json delta_or_text, const char* finish) {
          Json choice = {{"index", 0}, {"finish_reason", finish ? Json(finish) : Json(nullptr)},
                         {"logprobs", ChoiceLogprobs(want_logprobs, chat, pending, token_text, legacy)}};
          pending.clear();
          if (chat) {
            choice["delta"] = std::move(delta_or_text);
          } else {
            choice["text"] = std::move(delta_or_text);
          }
          Json body = {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"},
                       {"created", created}, {"model", model}, {"choices", Json::array({choice})}};
          const std::string event = Sse(body);
          return sink.write(event.data(), event.size());
        };
        bool first = true;
        auto emit_chat = [&](const ChatDelta& d) {
          Json delta = Json::object();
          if (first) delta["role"] = "assistant";
          if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
          if (!d.content.empty()) delta["content"] = d.content;
          if (delta.size() == (first ? 1u : 0u) && !first) return true;
          first = false;
          return chunk(delta, nullptr);
        };
        absl::StatusOr<GenerationOutcome> outcome = generation->Run(
            [&](const GenerationDelta& delta) {
              if (!sink.is_writable()) return false;
              if (want_logprobs.enabled) pending.insert(pending.end(), delta.tokens.begin(), delta.tokens.end());
              if (chat) return emit_chat(parser->Feed(delta.text));
              return delta.text.empty() ? true : chunk(delta.text, nullptr);
            },
            [&] { return !sink.is_writable() || DrainPassed(*config); });
        if (outcome.ok() && outcome->finish == nq::v1::FINISH_REASON_ABORT && DrainPassed(*config)) {
          outcome = DrainedError();
        }
        if (!outcome.ok()) {
          const std::string event = Sse(Json::parse(ToHttpError(outcome.status()).body));
          sink.write(event.data(), event.size());
        } else if (sink.is_writable()) {
          const char* finish = FinishReasonText(outcome->finish);
          if (chat) {
            emit_chat(parser->Finish());
            ParsedAssistant result = parser->Result();
            if (!result.tool_calls.empty()) {
              Json calls = Json::array();
              for (int i = 0; i < static_cast<int>(result.tool_calls.size()); ++i) {
                const nq::v1::ToolCall& call = result.tool_calls[i];
                calls.push_back({{"index", i}, {"id", call.id()}, {"type", "function"},
                                 {"function", {{"name", call.name()}, {"arguments", call.arguments_json()}}}});
              }
              chunk(Json{{"tool_calls", calls}}, nullptr);
              if (outcome->finish == nq::v1::FINISH_REASON_STOP) finish = "tool_calls";
            }
            chunk(Json::object(), finish);
          } else {
            chunk(std::string(), finish);
          }
          if (include_usage) {
            Json usage = {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"},
                          {"created", created}, {"model", model}, {"choices", Json::array()},
                          {"usage", UsageJson(outcome->usage)}};
            const std::string event = Sse(usage);
            sink.write(event.data(), event.size());
          }
        }
        const std::string done = "data: [DONE]\n\n";
        sink.write(done.data(), done.size());
        sink.done();
        return true;
      });
}

}  // namespace

void AddRouterRoutes(httplib::Server& server, HttpRoutesConfig config) {
  auto shared = std::make_shared<HttpRoutesConfig>(std::move(config));
  AddHealthRoute(server, shared->serving);
  AddMetricsRoute(server, metrics::Registry::Default());
  // Every answer of the API by status code (after the response is written, streams included):
  // with nq_requests_rejected_total and nq_request_success_total, /metrics accounts for every
  // request a client sent. Scrapes and health checks are left out.
  metrics::CounterFamily& responses = metrics::Registry::Default().Counter(
      "nq_http_responses_total", "Responses of the OpenAI-compatible API, by HTTP status code", {"code"});
  server.set_logger([&responses](const httplib::Request& request, const httplib::Response& response) {
    if (request.path == "/metrics" || request.path == "/health") return;
    responses.WithLabels({std::to_string(response.status)}).Increment();
  });

  server.Get("/v1/models", [shared](const httplib::Request& request, httplib::Response& response) {
    Route route{shared.get(), {}};
    if (absl::Status s = route.Authorize(request); !s.ok()) return SendError(response, s);
    absl::StatusOr<nq::v1::ModelInfo> info = CurrentModelInfo(*shared->worker, shared->served_model_name);
    if (!info.ok()) return SendError(response, info.status());
    Json model = {{"id", info->id()}, {"object", "model"}, {"created", info->created_unix()},
                  {"owned_by", "nestquant"}, {"max_model_len", info->max_model_len()}};
    response.set_content(Json{{"object", "list"}, {"data", Json::array({model})}}.dump(), "application/json");
  });
  server.Post("/v1/completions", [shared](const httplib::Request& request, httplib::Response& response) {
    ServeGeneration(*shared, request, response, /*chat=*/false);
  });
  server.Post("/v1/chat/completions", [shared](const httplib::Request& request, httplib::Response& response) {
    ServeGeneration(*shared, request, response, /*chat=*/true);
  });
  server.Post("/tokenize", [shared](const httplib::Request& request, httplib::Response& response) {
    Route route{shared.get(), {}};
    if (absl::Status s = route.Authorize(request); !s.ok()) return SendError(response, s);
    if (shared->generator == nullptr) return SendError(response, absl::UnavailableError("no tokenizer loaded"));
    Json body = Json::parse(request.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) return SendError(response, absl::InvalidArgumentError("the request body must be a JSON object"));
    std::string text;
    bool add_special = true;
    if (body.contains("messages")) {
      if (shared->chat == nullptr) return SendError(response, absl::UnimplementedError("no chat format configured"));
      absl::StatusOr<OpenAiRequest> chat = ParseChatRequest(
          Json{{"model", body.value("model", Json(""))}, {"messages", body["messages"]}}.dump());
      if (!chat.ok()) return SendError(response, chat.status());
      absl::StatusOr<std::string> rendered = shared->chat->Render(chat->chat_input);
      if (!rendered.ok()) return SendError(response, rendered.status());
      text = *rendered;
      add_special = false;
    } else if (body.contains("prompt") && body["prompt"].is_string()) {
      text = body["prompt"].get<std::string>();
      if (body.contains("add_special_tokens")) {
        if (!body["add_special_tokens"].is_boolean()) return SendError(response, absl::InvalidArgumentError("'add_special_tokens' must be a boolean"));
        add_special = body["add_special_tokens"].get<bool>();
      }
    } else {
      return SendError(response, absl::InvalidArgumentError("send 'prompt' (a string) or 'messages'"));
    }
    absl::StatusOr<std::vector<int32_t>> ids = shared->generator->tokenizer().Encode(text, add_special);
    if (!ids.ok()) return SendError(response, ids.status());
    std::optional<nq::v1::WorkerInfo> info = shared->worker->info();
    Json out = {{"tokens", *ids}, {"count", ids->size()}, {"max_model_len", info.has_value() ? info->max_model_len() : 0}};
    response.set_content(out.dump(), "application/json");
  });
  server.Post("/detokenize", [shared](const httplib::Request& request, httplib::Response& response) {
    Route route{shared.get(), {}};
    if (absl::Status s = route.Authorize(request); !s.ok()) return SendError(response, s);
    if (shared->generator == nullptr) return SendError(response, absl::UnavailableError("no tokenizer loaded"));
    Json body = Json::parse(request.body, nullptr, false);
    if (body.is_discarded() || !body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) {
      return SendError(response, absl::InvalidArgumentError("'tokens' must be an array of token ids"));
    }
    std::vector<int32_t> ids;
    for (const Json& id : body["tokens"]) {
      if (!id.is_number_integer()) return SendError(response, absl::InvalidArgumentError("'tokens' must be an array of token ids"));
      ids.push_back(id.get<int32_t>());
    }
    absl::StatusOr<std::string> text = shared->generator->tokenizer().Decode(ids, /*skip_special_tokens=*/false);
    if (!text.ok()) return SendError(response, text.status());
    response.set_content(Json{{"prompt", *text}}.dump(-1, ' ', false, Json::error_handler_t::replace), "application/json");
  });

  // OpenAI-shaped bodies for the errors httplib raises itself. httplib 0.11 calls this for every
  // status >= 400, also after a route's handler has written its own error (an unknown model is a
  // 404 too): a response with a body is left as the route wrote it.
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (!response.body.empty()) return;
    if (response.status == 404) {
      SendError(response, absl::NotFoundError("no route for " + request.method + " " + request.path));
    } else if (response.status == 413) {
      HttpError error = ToHttpError(absl::InvalidArgumentError("the request body is too large"));
      response.set_content(error.body, "application/json");
    } else if (response.status == 400) {
      SendError(response, absl::InvalidArgumentError("malformed HTTP request"));
    }
  });
}

}  // namespace nq::router
