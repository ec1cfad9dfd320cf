// The router's HTTP routes: the OpenAI-compatible API (/v1/completions,
// /v1/chat/completions with SSE, /v1/models), /tokenize, /detokenize, /health, /metrics.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <httplib.h>

#include "services/router/api_key.h"
#include "services/router/chat_adapter.h"
#include "services/router/generator.h"
#include "services/router/worker_connection.h"

namespace nq::router {

struct HttpRoutesConfig {
  WorkerConnection* worker = nullptr;
  Generator* generator = nullptr;      // null: no tokenizer, the generation routes answer 503
  const ChatAdapter* chat = nullptr;   // null: /v1/chat/completions answers 501
  const ApiKeyCheck* api_key = nullptr;
  std::string served_model_name;
  std::function<bool()> serving;  // the router's own health (worker ready and not draining)
  std::chrono::seconds request_timeout{600};
};

void AddRouterRoutes(httplib::Server& server, HttpRoutesConfig config);

}  // namespace nq::router
