#include "services/common/health_service.h"

#include <optional>

#include "absl/time/time.h"

namespace nq {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// The synchronous API tells a handler of a cancelled call only when asked: a Watch looks
// this often, so a client that leaves frees its server thread within this time.
constexpr absl::Duration kWatchCancelPoll = absl::Milliseconds(100);

}  // namespace

HealthService::HealthService(const std::vector<std::string>& service_names)
    : service_names_(service_names.begin(), service_names.end()) {}

void HealthService::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (!shut_down_) serving_ = serving;
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  serving_ = false;
  shut_down_ = true;
}

HealthService::ServingStatus HealthService::StatusLocked(const std::string& service_name) const {
  if (!service_name.empty() && service_names_.count(service_name) == 0) return HealthCheckResponse::SERVICE_UNKNOWN;
  return serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

grpc::Status HealthService::Check(grpc::ServerContext*, const HealthCheckRequest* request,
                                  HealthCheckResponse* response) {
  absl::MutexLock lock(&mu_);
  const ServingStatus status = StatusLocked(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "no health entry for the service '" + request->service() + "'");
  }
  response->set_status(status);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* context, const HealthCheckRequest* request,
                                  grpc::ServerWriter<HealthCheckResponse>* writer) {
  std::optional<ServingStatus> sent;
  while (!context->IsCancelled()) {
    ServingStatus now;
    bool shut_down;
    {
      absl::MutexLock lock(&mu_);
      auto news = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return shut_down_ || StatusLocked(request->service()) != sent;
      };
      mu_.AwaitWithTimeout(absl::Condition(&news), kWatchCancelPoll);
      now = StatusLocked(request->service());
      shut_down = shut_down_;
    }
    // Written outside the lock: a slow reader holds up its own stream, not SetServing.
    if (now != sent) {
      HealthCheckResponse response;
      response.set_status(now);
      if (!writer->Write(response)) break;  // the client is gone
      sent = now;
    }
    if (shut_down) break;
  }
  return grpc::Status::OK;
}

}  // namespace nq
