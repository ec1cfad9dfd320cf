#include "services/common/http_server.h"

#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace nq {

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP port ", options.port, " out of range"));
  }
  auto http = std::unique_ptr<HttpServer>(new HttpServer());
  httplib::Server& server = http->server_;
  server.set_payload_max_length(options.max_body_bytes);
  // Streaming requests hold their connection's thread for the whole generation, and queued
  // ones wait on it: size the pool well above the router's queue so a full queue is a quick
  // 429 rather than a connection stuck in the accept backlog.
  server.new_task_queue = [threads = options.threads] { return new httplib::ThreadPool(threads); };
  if (options.add_routes) options.add_routes(server);

  if (options.port == 0) {
    http->port_ = server.bind_to_any_port(options.host.c_str());
    if (http->port_ < 0) http->port_ = 0;
  } else if (server.bind_to_port(options.host.c_str(), options.port)) {
    http->port_ = options.port;
  }
  if (http->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for HTTP on ", options.host, ":", options.port,
                     ": the address is in use or not bindable (pick another with the port flag)"));
  }
  http->thread_ = std::thread([server = &http->server_] { server->listen_after_bind(); });
  // stop() is a no-op until the accept loop runs, so do not hand out a server before it does.
  while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return http;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  server_.stop();
  if (thread_.joinable()) thread_.join();
}

void AddMetricsRoute(httplib::Server& server, const metrics::Registry& registry, std::function<void()> before_scrape) {
  server.Get("/metrics", [&registry, before_scrape = std::move(before_scrape)](const httplib::Request&,
                                                                            httplib::Response& response) {
    if (before_scrape) before_scrape();
    response.set_content(registry.Serialize(), metrics::kContentType);
  });
}

void AddHealthRoute(httplib::Server& server, std::function<bool()> serving) {
  server.Get("/health", [serving = std::move(serving)](const httplib::Request&,
                                                       httplib::Response& response) {
    const bool ok = serving();
    response.status = ok ? 200 : 503;
    response.set_content(ok ? R"({"status":"SERVING"})" : R"({"status":"NOT_SERVING"})",
                         "application/json");
  });
}

}  // namespace nq
