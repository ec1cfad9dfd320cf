#include "services/common/grpc_server.h"

#include <grpcpp/ext/health_check_service_server_builder_option.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace nq {

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(GrpcServerOptions options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("gRPC port ", options.port, " out of range"));
  }
  // A process-wide switch; it must be set before the first ServerBuilder is built.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  const std::string address = absl::StrCat(options.host, ":", options.port);
  grpc::ServerBuilder builder;
  int selected_port = 0;
  builder.AddListeningPort(address,
                           options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
                           &selected_port);
  // gRPC sets SO_REUSEPORT by default, which would let a second server silently share a
  // port with the first; a port clash must be a startup error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  // grpc.health.v1 from our own service, NOT_SERVING before the server accepts its first call;
  // gRPC's default one (switched off here) answers SERVING until told otherwise, and the
  // server is already accepting when BuildAndStart returns (health_service.h).
  auto health = std::make_unique<HealthService>(options.health_service_names);
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.RegisterService(health.get());
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || selected_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for gRPC on ", address,
                     ": the address is in use or not bindable (pick another with the port flag)"));
  }
  return std::unique_ptr<GrpcServer>(
      new GrpcServer(std::move(health), std::move(server), std::move(options), selected_port));
}

GrpcServer::GrpcServer(std::unique_ptr<HealthService> health, std::unique_ptr<grpc::Server> server,
                       GrpcServerOptions options, int port)
    : health_(std::move(health)),
      server_(std::move(server)),
      options_(std::move(options)),
      port_(port),
      address_(absl::StrCat(options_.host, ":", port)) {}

GrpcServer::~GrpcServer() { Drain(std::chrono::system_clock::now()); }

void GrpcServer::SetServing(bool serving) {
  absl::MutexLock lock(&state_mu_);
  SetServingLocked(serving);
}

void GrpcServer::SetServingLocked(bool serving) {
  if (drained_.load(std::memory_order_acquire)) return;
  health_->SetServing(serving);  // the overall "" entry and every service name
  if (serving != serving_.load(std::memory_order_relaxed)) {
    spdlog::info("gRPC {} health: {}", address_, serving ? "SERVING" : "NOT_SERVING");
  }
  serving_.store(serving, std::memory_order_release);
}

void GrpcServer::Drain(std::chrono::system_clock::time_point deadline) {
  {
    absl::MutexLock lock(&state_mu_);
    if (drained_.load(std::memory_order_acquire)) return;
    SetServingLocked(false);
    // From here every SetServing returns at once: the health stays NOT_SERVING.
    drained_.store(true, std::memory_order_release);
  }
  // Ends open Watch calls now (gRPC's Shutdown would otherwise wait for them until `deadline`).
  health_->Shutdown();
  // Shutdown(deadline) stops new calls at once and cancels what is still running when the
  // deadline passes; Wait() joins the server's threads.
  server_->Shutdown(deadline);
  server_->Wait();
}

}  // namespace nq
