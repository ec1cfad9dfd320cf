#include "services/streamer/streamer_service.h"

#include <random>

#include <spdlog/spdlog.h>

#include "absl/strings/str_format.h"
#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

std::string NewInstanceId() {
  std::random_device device;
  return absl::StrFormat("%08x%08x", device(), device());
}

}  // namespace

StreamerService::StreamerService(WorkerRegistry* registry, metrics::Registry& metrics,
                                 std::optional<SlotLoaderOptions> loader_options, StreamerPeerOptions peer)
    : registry_(registry),
      peer_(std::move(peer)),
      loader_options_(std::move(loader_options)),
      loader_metrics_(metrics),
      instance_id_(NewInstanceId()),
      sessions_active_(metrics.Gauge("nq_streamer_sessions_active",
                                     "Worker control sessions currently open").Get()),
      routing_reports_(metrics.Counter("nq_streamer_routing_reports_total",
                                       "Routing reports received from workers").Get()),
      routing_tokens_(metrics.Counter("nq_streamer_routing_tokens_total",
                                      "Decode tokens covered by routing reports").Get()),
      unmap_acks_(metrics.Counter("nq_streamer_unmap_acks_total",
                                  "Slot unmap acknowledgements received from workers").Get()),
      sessions_failed_(metrics.Counter("nq_streamer_sessions_failed_total",
                                       "Worker sessions the streamer ended because their slot loader could not "
                                       "start (the worker retries)").Get()),
      lookahead_hints_(metrics.Counter("nq_streamer_lookahead_hints_received_total",
                                       "Gate lookahead hints received on worker sessions, whether or not a slot "
                                       "loader took them (nq_streamer_lookahead_hints_total says what it did)")
                           .Get()),
      follower_reports_dropped_(metrics.Counter("nq_streamer_follower_reports_dropped_total",
                                                "Routing reports from ranks > 0 of a tensor-parallel group, or sent "
                                                "before the group's loader started (rank 0's reports are the group's)")
                                    .Get()),
      groups_([this](std::vector<std::shared_ptr<RegisteredWorker>> members, const nq::v1::SessionHello& hello,
                     SlotLoader::Send send) -> absl::StatusOr<std::unique_ptr<SlotLoader>> {
        {
          absl::MutexLock lock(&files_mu_);
          if (!loader_options_.has_value()) return nullptr;
        }
        ASSIGN_OR_RETURN(SlotLoaderOptions options, LoaderOptions());
        ASSIGN_OR_RETURN(std::unique_ptr<SlotLoader> loader,
                         SlotLoader::CreateForGroup(std::move(members), options, &loader_metrics_, std::move(send)));
        RETURN_IF_ERROR(loader->Start(hello));
        return loader;
      }) {}

absl::StatusOr<SlotLoaderOptions> StreamerService::LoaderOptions() {
  absl::MutexLock lock(&files_mu_);
  if (!loader_options_.has_value()) return absl::FailedPreconditionError("the streamer has no release");
  if (loader_options_->files == nullptr) {
    absl::StatusOr<std::shared_ptr<RecordFiles>> files =
        RecordFiles::Open(loader_options_->record_dirs, loader_options_->store.direct_io);
    if (!files.ok()) return files.status();
    loader_options_->files = *std::move(files);
  }
  return *loader_options_;
}

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
  // Gate lookahead (issue #21) is for a single worker: a group's ranks take their changes at the
  // step rank 0 names, after the layer a hint is for has run on every rank.
  response->set_accepts_lookahead_hints(request->tp_group().empty());
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<SlotLoader>> StreamerService::StartLoader(
    const std::shared_ptr<RegisteredWorker>& worker, const nq::v1::SessionHello& hello,
    grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream) {
  {
    absl::MutexLock lock(&files_mu_);
    if (!loader_options_.has_value()) return nullptr;
  }
  if (worker->release_id.empty()) return nullptr;  // static expert bits: nothing to load
  ASSIGN_OR_RETURN(SlotLoaderOptions options, LoaderOptions());
  ASSIGN_OR_RETURN(std::unique_ptr<SlotLoader> loader,
                   SlotLoader::Create(worker, options, &loader_metrics_,
                                      [stream](const nq::v1::StreamerMessage& out) { return stream->Write(out); }));
  RETURN_IF_ERROR(loader->Start(hello));
  return loader;
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
  const nq::v1::SessionHello hello = message.hello();
  const std::string& worker_id = hello.worker_id();
  // A later registration of this rank (the worker reconnecting, or restarted) ends this
  // session through the cancel hook; ours then closes before that one's loader starts.
  absl::StatusOr<std::shared_ptr<RegisteredWorker>> worker =
      registry_->OpenSession(worker_id, [context] { context->TryCancel(); });
  if (!worker.ok()) return ToGrpcStatus(worker.status());
  const uint32_t rank = (*worker)->rank;
  const std::string tp_group = (*worker)->tp_group;
  if (!(*worker)->tp_group.empty() && !(*worker)->release_id.empty()) {
    if (!peer_.decider_address.empty()) return AppliedGroupSession(context, *worker, hello, stream);
    return GroupSession(context, *worker, hello, stream);
  }
  sessions_active_.Increment();
  spdlog::info("session of worker {} open ({} READY slots, applied generation {})", worker_id,
               hello.ready_slots_size(), hello.applied_generation());

  // The loader writes slot-table updates from its own thread; gRPC allows one writer
  // alongside this reader.
  absl::StatusOr<std::unique_ptr<SlotLoader>> loader = StartLoader(*worker, hello, stream);
  if (!loader.ok()) {
    // A session without its loader would look connected and never load a slot: end it, so the
    // worker's session fails, it serves at 2 bits meanwhile, and its retry gets a new loader
    // (a record directory back in place, say). Logged by the worker's retry loop too.
    sessions_failed_.Increment();
    spdlog::error("worker {}: session ended, its slot loader could not start: {}", worker_id,
                  loader.status().ToString());
    worker->reset();
    sessions_active_.Decrement();
    registry_->CloseSession(worker_id, rank, tp_group);
    return ToGrpcStatus(Annotate(loader.status(), "streamer slot loader"));
  }

  while (stream->Read(&message)) {
    switch (message.message_case()) {
      case nq::v1::WorkerMessage::kRouting:
        routing_reports_.Increment();
        routing_tokens_.Increment(message.routing().num_tokens());
        if (*loader) (*loader)->OnRouting(std::move(*message.mutable_routing()));
        break;
      case nq::v1::WorkerMessage::kUnmapAck:
        unmap_acks_.Increment();
        if (*loader) (*loader)->OnUnmapAck(std::move(*message.mutable_unmap_ack()));
        break;
      case nq::v1::WorkerMessage::kLookahead:
        // Without a loader (no release here) there is nothing to load: the hint is only counted.
        lookahead_hints_.Increment();
        if (*loader) (*loader)->OnLookahead(std::move(*message.mutable_lookahead()));
        break;
      default:
        spdlog::warn("worker {} sent an unexpected {} message; ignored", worker_id,
                     static_cast<int>(message.message_case()));
    }
  }
  // Stop the loader before the arena can be unmapped.
  if (*loader) (*loader)->Stop();
  loader->reset();
  worker->reset();
  sessions_active_.Decrement();
  registry_->CloseSession(worker_id, rank, tp_group);
  return context->IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled")
                                : grpc::Status::OK;
}

grpc::Status StreamerService::GroupSession(
    grpc::ServerContext* context, const std::shared_ptr<RegisteredWorker>& worker, const nq::v1::SessionHello& hello,
    grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream) {
  const std::string worker_id = worker->worker_id;
  const std::string group = worker->tp_group;
  const uint32_t rank = worker->rank;
  sessions_active_.Increment();
  spdlog::info("session of worker {} (rank {} of tensor-parallel group {}) open ({} READY slots, applied generation {})",
               worker_id, rank, group, hello.ready_slots_size(), hello.applied_generation());
  absl::Status joined = groups_.Join(
      worker, hello, [stream](const nq::v1::StreamerMessage& out) { return stream->Write(out); },
      [context] { context->TryCancel(); });
  if (!joined.ok()) {
    sessions_failed_.Increment();
    spdlog::error("worker {}: session ended, its group's slot loader could not start: {}", worker_id,
                  joined.ToString());
    groups_.Leave(group, rank, worker_id);
    sessions_active_.Decrement();
    registry_->CloseSession(worker_id, rank, group);
    return ToGrpcStatus(Annotate(joined, "streamer group slot loader"));
  }
  nq::v1::WorkerMessage message;
  while (stream->Read(&message)) {
    switch (message.message_case()) {
      case nq::v1::WorkerMessage::kRouting:
        routing_reports_.Increment();
        routing_tokens_.Increment(message.routing().num_tokens());
        if (!groups_.OnRouting(group, rank, std::move(*message.mutable_routing()))) {
          follower_reports_dropped_.Increment();
        }
        break;
      case nq::v1::WorkerMessage::kUnmapAck:
        unmap_acks_.Increment();
        groups_.OnUnmapAck(group, rank, std::move(*message.mutable_unmap_ack()));
        break;
      default:
        spdlog::warn("worker {} sent an unexpected {} message; ignored", worker_id,
                     static_cast<int>(message.message_case()));
    }
  }
  // Stops the group's loader before this rank's arena can be unmapped.
  groups_.Leave(group, rank, worker_id);
  sessions_active_.Decrement();
  registry_->CloseSession(worker_id, rank, group);
  return context->IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled")
                                : grpc::Status::OK;
}

}  // namespace nq::streamer
