#include "services/streamer/streamer_service.h"

#include <random>

#include <spdlog/spdlog.h>

#include "absl/strings/str_format.h"
#include "services/common/status_grpc.h"

namespace nq::streamer {
namespace {

std::string NewInstanceId() {
  std::random_device device;
  return absl::StrFormat("%08x%08x", device(), device());
}

}  // namespace

StreamerService::StreamerService(WorkerRegistry* registry, metrics::Registry& metrics)
    : registry_(registry),
      instance_id_(NewInstanceId()),
      sessions_active_(metrics.Gauge("nq_streamer_sessions_active",
                                     "Worker control sessions currently open").Get()),
      routing_reports_(metrics.Counter("nq_streamer_routing_reports_total",
                                       "Routing reports received from workers").Get()),
      routing_tokens_(metrics.Counter("nq_streamer_routing_tokens_total",
                                      "Decode tokens covered by routing reports").Get()),
      unmap_acks_(metrics.Counter("nq_streamer_unmap_acks_total",
                                  "Slot unmap acknowledgements received from workers").Get()) {}

grpc::Status StreamerService::RegisterWorker(grpc::ServerContext* context,
                                             const nq::v1::RegisterWorkerRequest* request,
                                             nq::v1::RegisterWorkerResponse* response) {
  absl::StatusOr<std::string> id = registry_->Register(*request);
  if (!id.ok()) {
    spdlog::warn("refused registration of rank {} (pid {}): {}", request->rank(), request->pid(),
                 id.status().ToString());
    return ToGrpcStatus(id.status());
  }
  response->set_worker_id(*id);
  response->set_streamer_instance_id(instance_id_);
  response->set_report_interval_tokens(kReportIntervalTokens);
  return grpc::Status::OK;
}

grpc::Status StreamerService::Session(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream) {
  nq::v1::WorkerMessage message;
  if (!stream->Read(&message)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "session closed before its hello");
  }
  if (!message.has_hello()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first session message must be a hello");
  }
  const std::string worker_id = message.hello().worker_id();
  if (absl::Status opened = registry_->OpenSession(worker_id); !opened.ok()) {
    return ToGrpcStatus(opened);
  }
  sessions_active_.Increment();
  spdlog::info("session of worker {} open ({} READY slots, applied generation {})", worker_id,
               message.hello().ready_slots_size(), message.hello().applied_generation());

  while (stream->Read(&message)) {
    switch (message.message_case()) {
      case nq::v1::WorkerMessage::kRouting:
        routing_reports_.Increment();
        routing_tokens_.Increment(message.routing().num_tokens());
        break;
      case nq::v1::WorkerMessage::kUnmapAck:
        unmap_acks_.Increment();
        break;
      default:
        spdlog::warn("worker {} sent an unexpected {} message; ignored", worker_id,
                     static_cast<int>(message.message_case()));
    }
  }
  sessions_active_.Decrement();
  registry_->CloseSession(worker_id);
  return context->IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled")
                                : grpc::Status::OK;
}

}  // namespace nq::streamer
