// nq-router: the public face of a deployment. OpenAI-compatible HTTP (port 8000) and gRPC
// nq.v1.Inference (port 8001), in front of the leader worker.
#include <chrono>
#include <memory>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "services/common/flag_checks.h"
#include "services/common/grpc_server.h"
#include "services/common/http_server.h"
#include "services/common/internal_tls.h"
#include "services/common/metrics/registry.h"
#include "services/common/service_main.h"
#include "services/common/shutdown_signal.h"
#include "services/common/status_macros.h"
#include "services/router/api_key.h"
#include "services/router/chat_adapter_impl.h"
#include "services/router/generator.h"
#include "services/router/http_routes.h"
#include "services/router/inference_service.h"
#include "services/router/scheduler.h"
#include "services/router/worker_connection.h"
#include "services/tokenizer/tokenizer.h"
#include <cstdlib>

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on");
ABSL_FLAG(int, http_port, 8000, "OpenAI-compatible HTTP API, /health and /metrics");
ABSL_FLAG(int, grpc_port, 8001, "gRPC nq.v1.Inference");
ABSL_FLAG(std::string, worker_address, "127.0.0.1:8100", "host:port of the leader worker (rank 0)");
ABSL_FLAG(std::string, served_model_name, "", "Model name clients use (default: the worker's model id)");
ABSL_FLAG(double, worker_poll_interval_s, 0.5, "Seconds between health checks of the leader worker");
ABSL_FLAG(double, drain_timeout_s, 30, "On SIGTERM, seconds to finish running requests");
ABSL_FLAG(std::string, tokenizer, "", "The model's tokenizer.json (empty: the generation routes answer 503)");
ABSL_FLAG(std::string, chat_format, "auto",
          "Chat template and output parser: glm5, deepseek_v3, none, auto (from the worker's architecture), or "
          "plain (a base model without chat markup, e.g. the embedded glm5_nano: the messages' text, continued as "
          "content)");
ABSL_FLAG(int, max_waiting, 16, "Requests that may wait for the worker; more get 429 / RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_tokens_limit, 4096, "Largest max_tokens a request may ask for");
ABSL_FLAG(int, default_max_tokens, 256, "max_tokens of a request that sets none");
ABSL_FLAG(double, request_timeout_s, 600, "A request's deadline, queue wait included");
ABSL_FLAG(int64_t, max_body_bytes, 8 << 20, "Largest HTTP request body (larger: 413)");
ABSL_FLAG(std::string, api_key, "",
          "Require 'Authorization: Bearer <key>' on the API: every HTTP route but /health and /metrics, and every "
          "nq.v1.Inference call (as 'authorization' metadata; gRPC health stays open). Also read from $NQ_API_KEY; "
          "never logged");

namespace nq::router {
namespace {

absl::Status CheckFlags() {
  RETURN_IF_ERROR(CheckPortFlag("http_port", absl::GetFlag(FLAGS_http_port), true));
  RETURN_IF_ERROR(CheckPortFlag("grpc_port", absl::GetFlag(FLAGS_grpc_port), true));
  RETURN_IF_ERROR(CheckAddressFlag("worker_address", absl::GetFlag(FLAGS_worker_address)));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("worker_poll_interval_s",
                                           absl::GetFlag(FLAGS_worker_poll_interval_s)));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("request_timeout_s", absl::GetFlag(FLAGS_request_timeout_s)));
  if (absl::GetFlag(FLAGS_max_waiting) < 0) return absl::InvalidArgumentError("--max_waiting must be >= 0");
  if (absl::GetFlag(FLAGS_max_tokens_limit) < 1 || absl::GetFlag(FLAGS_default_max_tokens) < 1) {
    return absl::InvalidArgumentError("--max_tokens_limit and --default_max_tokens must be positive");
  }
  if (absl::GetFlag(FLAGS_max_body_bytes) < 1024) return absl::InvalidArgumentError("--max_body_bytes must be >= 1024");
  return absl::OkStatus();
}

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

absl::Status Run(ShutdownSignal& shutdown) {
  RETURN_IF_ERROR(CheckFlags());
  std::atomic<bool> draining{false};
  GrpcServer* grpc_server_ptr = nullptr;
  absl::Mutex serving_mu;
  // The router dials the leader worker with the cluster's mutual TLS when it is configured.
  ASSIGN_OR_RETURN(std::shared_ptr<const InternalTls> tls, InternalTlsFromFlags());
  WorkerConnection worker(
      absl::GetFlag(FLAGS_worker_address), Millis(absl::GetFlag(FLAGS_worker_poll_interval_s)),
      [&](bool ready) {
        absl::MutexLock lock(&serving_mu);
        if (grpc_server_ptr != nullptr && !draining) {
          grpc_server_ptr->SetServing(ready);
        }
      },
      tls);
  metrics::Registry& registry = metrics::Registry::Default();
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  if (const std::string path = absl::GetFlag(FLAGS_tokenizer); !path.empty()) {
    ASSIGN_OR_RETURN(tokenizer, tokenizer::Tokenizer::FromFile(path));
    spdlog::info("tokenizer {}: {} tokens", path, tokenizer->vocab_size());
  }
  Scheduler scheduler(static_cast<size_t>(absl::GetFlag(FLAGS_max_waiting)), registry);
  std::unique_ptr<Generator> generator;
  if (tokenizer != nullptr) {
    generator = std::make_unique<Generator>(
        &worker, tokenizer.get(), &scheduler,
        GenerationLimits{.max_tokens_limit = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_tokens_limit)),
                         .default_max_tokens = static_cast<uint32_t>(absl::GetFlag(FLAGS_default_max_tokens))},
        registry);
  }
  std::string key = absl::GetFlag(FLAGS_api_key);
  if (const char* env = std::getenv("NQ_API_KEY"); key.empty() && env != nullptr) key = env;
  const ApiKeyCheck api_key(key);
  // The chat format: named, or taken from the model's architecture once the worker reports it.
  std::unique_ptr<ChatAdapter> chat;
  const std::string chat_format = absl::GetFlag(FLAGS_chat_format);
  if (chat_format != "none" && chat_format != "auto") {
    ASSIGN_OR_RETURN(chat, MakeChatAdapter(chat_format));
  }
  AutoChatAdapter auto_chat(&worker);
  const ChatAdapter* chat_adapter = chat_format == "auto" ? &auto_chat : chat.get();
  DrainDeadline http_drain;
  InferenceService service(&worker, generator.get(), chat_adapter, absl::GetFlag(FLAGS_served_model_name), &api_key);
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> grpc_server,
                   GrpcServer::Start(GrpcServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_grpc_port),
                       .services = {&service},
                       .health_service_names = {"nq.v1.Inference"},
                   }));
  ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> http_server,
                   HttpServer::Start(HttpServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_http_port),
                       .add_routes =
                           [&](httplib::Server& server) {
                             AddRouterRoutes(server, HttpRoutesConfig{
                                                         .worker = &worker,
                                                         .generator = generator.get(),
                                                         .chat = chat_adapter,
                                                         .api_key = &api_key,
                                                         .served_model_name = absl::GetFlag(
                                                             FLAGS_served_model_name),
                                                         .serving = [&] {
                                                           return worker.ready() && !draining;
                                                         },
                                                         .request_timeout = std::chrono::seconds(static_cast<int64_t>(
                                                             absl::GetFlag(FLAGS_request_timeout_s))),
                                                         .drain = &http_drain,
                                                     });
                           },
                       .max_body_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_body_bytes)),
                   }));
  {
    absl::MutexLock lock(&serving_mu);
    grpc_server_ptr = grpc_server.get();
  }
  worker.Start();
  spdlog::info("nq-router: HTTP on :{}, gRPC on {}, leader worker {}", http_server->port(),
               grpc_server->address(), worker.address());

  shutdown.Wait();
  spdlog::info("signal {} received: draining (up to {} s)", shutdown.signal_number(),
               absl::GetFlag(FLAGS_drain_timeout_s));
  {
    absl::MutexLock lock(&serving_mu);
    draining = true;
  }
  // One deadline for both APIs: HTTP generations still running at it end with UNAVAILABLE,
  // so Stop() (which waits for every handler) returns by then.
  const std::chrono::milliseconds drain_timeout = Millis(absl::GetFlag(FLAGS_drain_timeout_s));
  http_drain.Set(std::chrono::steady_clock::now() + drain_timeout);
  grpc_server->Drain(std::chrono::system_clock::now() + drain_timeout);
  http_server->Stop();
  worker.Stop();
  spdlog::info("nq-router stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::router

int main(int argc, char** argv) {
  return nq::ServiceMain(argc, argv, "router", "NestQuant router: OpenAI-compatible HTTP and gRPC nq.v1.Inference",
                         nq::router::Run);
}
