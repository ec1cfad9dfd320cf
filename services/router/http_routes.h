// The router's HTTP routes: /health, /metrics, and the OpenAI-compatible API.
#pragma once

#include <functional>
#include <string>

#include <httplib.h>

#include "services/router/worker_connection.h"

namespace nq::router {

struct HttpRoutesConfig {
  WorkerConnection* worker = nullptr;
  std::string served_model_name;
  std::function<bool()> serving;  // the router's own health (worker ready and not draining)
};

void AddRouterRoutes(httplib::Server& server, HttpRoutesConfig config);

}  // namespace nq::router
