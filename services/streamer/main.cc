// nq-streamer: one per node. Owns the NestQuant record directory, maps every worker's slot
// arena, and (issue #6) streams residual records into slots chosen by the predictor.
#include <sys/stat.h>

#include <chrono>
#include <memory>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "services/common/flag_checks.h"
#include "services/common/grpc_server.h"
#include "services/common/http_server.h"
#include "services/common/logging.h"
#include "services/common/metrics/registry.h"
#include "services/common/shutdown_signal.h"
#include "services/common/status_macros.h"
#include "services/streamer/streamer_service.h"
#include "services/streamer/worker_registry.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on");
ABSL_FLAG(int, grpc_port, 8200, "nq.v1.Streamer gRPC port (workers -> streamer)");
ABSL_FLAG(int, metrics_port, 8201, "HTTP port for /metrics and /health");
ABSL_FLAG(std::string, records_dir, "",
          "NestQuant release directory to stream records from (empty: none yet; every expert "
          "runs at 2 bits)");
ABSL_FLAG(double, drain_timeout_s, 10, "On SIGTERM, seconds to let sessions close");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");

namespace nq::streamer {
namespace {

absl::Status CheckFlags() {
  RETURN_IF_ERROR(CheckPortFlag("grpc_port", absl::GetFlag(FLAGS_grpc_port), true));
  RETURN_IF_ERROR(CheckPortFlag("metrics_port", absl::GetFlag(FLAGS_metrics_port), true));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)));
  const std::string dir = absl::GetFlag(FLAGS_records_dir);
  struct stat st;
  if (!dir.empty() && (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
    return absl::NotFoundError(absl::StrCat("--records_dir=", dir, ": not a directory"));
  }
  return absl::OkStatus();
}

absl::Status Run(ShutdownSignal& shutdown) {
  RETURN_IF_ERROR(CheckFlags());
  metrics::Registry& registry = metrics::Registry::Default();
  WorkerRegistry workers(registry);
  StreamerService service(&workers, registry);
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> grpc_server,
                   GrpcServer::Start(GrpcServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_grpc_port),
                       .services = {&service},
                       .health_service_names = {"nq.v1.Streamer"},
                   }));
  ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> http_server,
                   HttpServer::Start(HttpServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_metrics_port),
                       .add_routes =
                           [&](httplib::Server& server) {
                             AddMetricsRoute(server, registry);
                             AddHealthRoute(server, [&] { return grpc_server->serving(); });
                           },
                   }));
  // Nothing else to wait for: the record directory (if any) was checked above.
  grpc_server->SetServing(true);
  spdlog::info("nq-streamer {}: gRPC on {}, metrics on :{}", service.instance_id(),
               grpc_server->address(), http_server->port());

  shutdown.Wait();
  spdlog::info("signal {} received: draining (up to {} s)", shutdown.signal_number(),
               absl::GetFlag(FLAGS_drain_timeout_s));
  // Sessions are open-ended streams: Drain cancels them at the deadline, and workers fall
  // back to 2 bits and retry.
  grpc_server->Drain(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(
                         absl::GetFlag(FLAGS_drain_timeout_s) * 1000)));
  http_server->Stop();
  spdlog::info("nq-streamer stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::streamer

int main(int argc, char** argv) {
  if (absl::Status s = nq::ShutdownSignal::BlockTerminationSignals(); !s.ok()) {
    std::fprintf(stderr, "nq-streamer: %s\n", s.ToString().c_str());
    return 1;
  }
  absl::SetProgramUsageMessage("NestQuant streamer: one per node; serves nq.v1.Streamer");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = nq::InitLogging("streamer", absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::fprintf(stderr, "nq-streamer: %s\n", s.ToString().c_str());
    return 2;
  }
  nq::ShutdownSignal shutdown;
  if (absl::Status s = nq::streamer::Run(shutdown); !s.ok()) {
    spdlog::critical("nq-streamer failed: {}", s.ToString());
    return 1;
  }
  return 0;
}
