// An HTTP server (cpp-httplib) on its own thread, for /metrics and /health on every service
// and for the router's OpenAI-compatible API.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <httplib.h>

#include "absl/status/statusor.h"
#include "services/common/metrics/registry.h"

namespace nq {

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0 picks a free port (tests); see HttpServer::port().
  // Called once before listening to add routes.
  std::function<void(httplib::Server&)> add_routes;
  // Largest request body accepted; larger bodies get 413.
  size_t max_body_bytes = 8 << 20;
  // Connections served at once (each holds a thread while it is served).
  size_t threads = 64;
};

class HttpServer {
 public:
  // Binds and starts serving on a background thread. UNAVAILABLE naming the address when the
  // port cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options);
  ~HttpServer();

  int port() const { return port_; }
  // Stops accepting and joins the serving thread. Idempotent.
  void Stop();

 private:
  HttpServer() = default;

  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
};

// GET /metrics: the registry in the Prometheus text format.
// `before_scrape`, when set, runs before each serialisation (gauges read at scrape time, such as
// a GPU's free memory).
void AddMetricsRoute(httplib::Server& server, const metrics::Registry& registry,
                     std::function<void()> before_scrape = nullptr);

// GET /health: 200 {"status":"SERVING"} when serving() is true, 503 {"status":"NOT_SERVING"}
// otherwise (load balancers and Kubernetes probes read the code).
void AddHealthRoute(httplib::Server& server, std::function<bool()> serving);

}  // namespace nq
