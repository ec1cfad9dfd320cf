// A gRPC server with what every NestQuant service needs: grpc.health.v1 (NOT_SERVING from the
// first call it accepts until the service says otherwise; health_service.h), server
// reflection, an exclusive port, and a drain that stops accepting, lets in-flight calls finish
// up to a deadline, then cancels the rest.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "services/common/health_service.h"

namespace nq {

struct GrpcServerOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0 picks a free port (tests); see GrpcServer::port().
  // Services to register; not owned, must outlive the server.
  std::vector<grpc::Service*> services;
  // Names reported by grpc.health.v1 besides the overall "" entry, e.g. "nq.v1.Worker".
  std::vector<std::string> health_service_names;
  // Largest message accepted (routing reports of a big model can be a few MB).
  int max_receive_message_bytes = 64 << 20;
  // How callers are authenticated (internal_tls.h); null listens in plain text.
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

class GrpcServer {
 public:
  // Binds and starts. UNAVAILABLE naming the address when the port cannot be bound (already
  // in use, permission), INVALID_ARGUMENT for a bad port.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(GrpcServerOptions options);
  ~GrpcServer();

  // Sets every health entry ("" and the service names) to SERVING or NOT_SERVING. Any
  // thread; after Drain it does nothing. Calls from several threads are serialised.
  void SetServing(bool serving);
  // Any thread (the health state a service last set).
  bool serving() const { return serving_.load(std::memory_order_acquire); }
  int port() const { return port_; }
  const std::string& address() const { return address_; }

  // Health to NOT_SERVING, stop accepting calls, wait for in-flight calls up to `deadline`,
  // cancel those still running, and return when the server has stopped. Idempotent: a
  // second call (another thread, the destructor) returns at once.
  void Drain(std::chrono::system_clock::time_point deadline);

 private:
  GrpcServer(std::unique_ptr<HealthService> health, std::unique_ptr<grpc::Server> server, GrpcServerOptions options,
             int port);
  void SetServingLocked(bool serving) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);

  // Registered with server_, so declared first: it outlives the server.
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<grpc::Server> server_;
  GrpcServerOptions options_;
  int port_;
  std::string address_;
  // SetServing is called from a service's own threads (a watcher, a session) while Drain
  // runs on the signal-handling thread. state_mu_ orders each health change against the
  // drain, so no SetServing(true) lands after Drain's NOT_SERVING; the atomics let serving()
  // and a repeated Drain read the state without taking it.
  absl::Mutex state_mu_;
  std::atomic<bool> serving_{false};
  std::atomic<bool> drained_{false};
};

}  // namespace nq
