// The router's HTTP routes: the OpenAI-compatible API (/v1/completions,
// /v1/chat/completions with SSE, /v1/models), /tokenize, /detokenize, /health, /metrics.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>

#include <httplib.h>

#include "services/router/api_key.h"
#include "services/router/chat_adapter.h"
#include "services/router/generator.h"
#include "services/router/worker_connection.h"

namespace nq::router {

// The end of the router's drain (--drain_timeout_s after SIGTERM). Set once by main; every
// running or queued HTTP generation polls it and ends with UNAVAILABLE once it has passed,
// so the HTTP server can stop by the deadline instead of when the last generation finishes.
class DrainDeadline {
 public:
  void Set(std::chrono::steady_clock::time_point deadline) {
    ns_.store(deadline.time_since_epoch().count(), std::memory_order_release);
  }
  bool Passed() const {
    return std::chrono::steady_clock::now().time_since_epoch().count() >= ns_.load(std::memory_order_acquire);
  }

 private:
  std::atomic<std::chrono::steady_clock::rep> ns_{std::chrono::steady_clock::time_point::max().time_since_epoch().count()};
};

struct HttpRoutesConfig {
  WorkerConnection* worker = nullptr;
  Generator* generator = nullptr;      // null: no tokenizer, the generation routes answer 503
  const ChatAdapter* chat = nullptr;   // null: /v1/chat/completions answers 501
  const ApiKeyCheck* api_key = nullptr;
  std::string served_model_name;
  std::function<bool()> serving;  // the router's own health (worker ready and not draining)
  std::chrono::seconds request_timeout{600};
  const DrainDeadline* drain = nullptr;  // null: requests are never ended by a drain
};

void AddRouterRoutes(httplib::Server& server, HttpRoutesConfig config);

}  // namespace nq::router
