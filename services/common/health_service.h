// grpc.health.v1 for GrpcServer: NOT_SERVING from the first call the server accepts until the
// service says SERVING.
//
// gRPC's default health service cannot promise that: it starts the overall "" entry at
// SERVING inside BuildAndStart, so a Check that lands before the caller can set NOT_SERVING
// sees a process that is still starting as ready (a router with no worker behind it and its
// HTTP port not yet bound; the serving tests then posted to that port, were refused, and
// aborted). This service is registered in its place and answers from its own state.
#pragma once

#include <set>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace nq {

class HealthService final : public grpc::health::v1::Health::Service {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // The entries are "" (the server as a whole) and `service_names`; every one is NOT_SERVING
  // until SetServing(true). Another name is NOT_FOUND to Check and SERVICE_UNKNOWN to Watch,
  // as the protocol asks.
  explicit HealthService(const std::vector<std::string>& service_names);

  // Every entry to SERVING or NOT_SERVING. Any thread; after Shutdown it does nothing.
  void SetServing(bool serving);
  // NOT_SERVING for good: open Watch calls send it and end, so the server's shutdown does not
  // wait for them until its deadline.
  void Shutdown();

  grpc::Status Check(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  // Sends the entry's status, then each change, until the client leaves or Shutdown.
  grpc::Status Watch(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  ServingStatus StatusLocked(const std::string& service_name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const std::set<std::string> service_names_;
  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace nq
