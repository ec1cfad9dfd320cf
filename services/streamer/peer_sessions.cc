// StreamerService's sessions of groups spanning nodes (docs/tp_streamers.md): on an applying
// streamer, a rank's session linked to the decider (AppliedGroupSession); on the deciding one, a
// remote rank's link (RankLink).
#include "services/streamer/streamer_service.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"
#include "services/streamer/remote_rank.h"

namespace nq::streamer {

grpc::Status StreamerService::AppliedGroupSession(
    grpc::ServerContext* context, const std::shared_ptr<RegisteredWorker>& worker, const nq::v1::SessionHello& hello,
    grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream) {
  const std::string worker_id = worker->worker_id;
  const std::string group = worker->tp_group;
  const uint32_t rank = worker->rank;
  sessions_active_.Increment();
  absl::StatusOr<std::unique_ptr<RankApplier>> applier = [&]() -> absl::StatusOr<std::unique_ptr<RankApplier>> {
    ASSIGN_OR_RETURN(SlotLoaderOptions options, LoaderOptions());
    return RankApplier::Start(
        worker, hello, options,
        RankApplierOptions{
            .decider_address = peer_.decider_address, .tls = peer_.tls, .streamer_instance_id = instance_id_},
        &loader_metrics_, [context] { context->TryCancel(); });
  }();
  if (!applier.ok()) {
    // The worker retries; it serves at 2 bits meanwhile.
    sessions_failed_.Increment();
    spdlog::error("worker {}: session ended, it could not be linked to the deciding streamer: {}", worker_id,
                  applier.status().ToString());
    sessions_active_.Decrement();
    registry_->CloseSession(worker_id, rank, group);
    return ToGrpcStatus(Annotate(applier.status(), "streamer link to the decider"));
  }
  spdlog::info("session of worker {} (rank {} of tensor-parallel group {}) open; the streamer at {} decides for it",
               worker_id, rank, group, peer_.decider_address);
  nq::v1::WorkerMessage message;
  while (stream->Read(&message)) {
    switch (message.message_case()) {
      case nq::v1::WorkerMessage::kRouting:
        // Rank 0's reports are the group's, and rank 0 is the decider's.
        routing_reports_.Increment();
        follower_reports_dropped_.Increment();
        break;
      case nq::v1::WorkerMessage::kUnmapAck:
        unmap_acks_.Increment();
        (*applier)->ForwardUnmapAck(message.unmap_ack());
        break;
      default:
        spdlog::warn("worker {} sent an unexpected {} message; ignored", worker_id,
                     static_cast<int>(message.message_case()));
    }
  }
  // Nothing writes the rank's arena once this returns; then it may be unmapped.
  (*applier)->Stop();
  applier->reset();
  sessions_active_.Decrement();
  registry_->CloseSession(worker_id, rank, group);
  return context->IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled")
                                : grpc::Status::OK;
}

grpc::Status StreamerService::RankLink(
    grpc::ServerContext* context, grpc::ServerReaderWriter<nq::v1::DeciderMessage, nq::v1::PeerRankMessage>* stream) {
  nq::v1::PeerRankMessage message;
  if (!stream->Read(&message)) return grpc::Status(grpc::StatusCode::CANCELLED, "link closed before its hello");
  if (!message.has_hello()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first link message must be a hello");
  }
  if (!peer_.decider_address.empty()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("this streamer applies the decisions of ", peer_.decider_address,
                     " (--decider_address); link ranks to that streamer")));
  }
  const nq::v1::PeerRankHello hello = message.hello();
  absl::StatusOr<std::shared_ptr<RegisteredWorker>> rank =
      RemoteRank(hello, registry_->release_id(), [stream](const nq::v1::LoadOrder& order) {
        nq::v1::DeciderMessage out;
        *out.mutable_order() = order;
        return stream->Write(out);
      });
  if (!rank.ok()) {
    spdlog::warn("refused the link of a remote rank: {}", rank.status().ToString());
    return ToGrpcStatus(rank.status());
  }
  const std::string group = (*rank)->tp_group;
  const uint32_t r = (*rank)->rank;
  const std::string id = (*rank)->worker_id;
  // Only rank 0's session receives updates: a remote rank is never sent one.
  absl::Status joined = groups_.Join(
      *rank, hello.session(), [](const nq::v1::StreamerMessage&) { return false; },
      [context] { context->TryCancel(); });
  if (!joined.ok()) {
    spdlog::error("remote rank {}: its group's loader could not take it: {}", id, joined.ToString());
    groups_.Leave(group, r, id);
    return ToGrpcStatus(joined);
  }
  loader_metrics_.peer_links_active.Increment();
  spdlog::info("rank {} of tensor-parallel group {} linked from the streamer on {} (instance {})", r, group,
               (*rank)->hostname, hello.streamer_instance_id());
  while (stream->Read(&message)) {
    switch (message.message_case()) {
      case nq::v1::PeerRankMessage::kLoaded:
        groups_.OnPeerLoaded(group, r, std::move(*message.mutable_loaded()));
        break;
      case nq::v1::PeerRankMessage::kUnmapAck:
        unmap_acks_.Increment();
        groups_.OnUnmapAck(group, r, std::move(*message.mutable_unmap_ack()));
        break;
      default:
        spdlog::warn("remote rank {} sent an unexpected {} message; ignored", id,
                     static_cast<int>(message.message_case()));
    }
  }
  // Stops the group's loader (no order goes out on this stream after) and ends the other ranks'
  // sessions, so the group re-forms from fresh hellos.
  groups_.Leave(group, r, id);
  loader_metrics_.peer_links_active.Decrement();
  spdlog::info("rank {} of tensor-parallel group {}: the link from the streamer on {} ended", r, group,
               (*rank)->hostname);
  return context->IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED, "link cancelled") : grpc::Status::OK;
}

}  // namespace nq::streamer
