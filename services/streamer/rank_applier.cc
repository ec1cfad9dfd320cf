#include "services/streamer/rank_applier.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

std::shared_ptr<grpc::Channel> DeciderChannel(const RankApplierOptions& options) {
  grpc::ChannelArguments args;
  // The link is a long-lived stream without a deadline: keepalive pings notice a decider whose
  // node vanished without closing the socket, so the rank falls back and re-forms promptly.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  return InternalChannel(options.decider_address, options.tls.get(), args);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RankApplier>> RankApplier::Start(std::shared_ptr<RegisteredWorker> rank,
                                                                const nq::v1::SessionHello& hello,
                                                                const SlotLoaderOptions& loader_options,
                                                                const RankApplierOptions& options,
                                                                LoaderMetrics* metrics,
                                                                std::function<void()> end_session) {
  if (rank->rank == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank 0 of tensor-parallel group ", rank->tp_group, " registered with a streamer that applies the decisions of ",
        options.decider_address, " (--decider_address); rank 0 registers with the deciding streamer"));
  }
  auto applier = std::unique_ptr<RankApplier>(new RankApplier(rank, std::move(end_session)));
  RankApplier* self = applier.get();
  ASSIGN_OR_RETURN(applier->runner_,
                   PeerOrderRunner::Create(rank, loader_options.files, loader_options.store, metrics,
                                           [self](const nq::v1::LoadResult& result) {
                                             nq::v1::PeerRankMessage message;
                                             *message.mutable_loaded() = result;
                                             (void)self->Write(message);
                                           }));
  applier->stub_ = nq::v1::StreamerPeer::NewStub(DeciderChannel(options));
  applier->stream_ = applier->stub_->RankLink(&applier->context_);

  nq::v1::PeerRankMessage message;
  nq::v1::PeerRankHello* peer_hello = message.mutable_hello();
  nq::v1::RegisterWorkerRequest* registration = peer_hello->mutable_registration();
  registration->set_rank(rank->rank);
  registration->set_world_size(rank->world_size);
  registration->set_pid(rank->pid);
  registration->set_hostname(rank->hostname);
  registration->set_release_id(rank->release_id);
  *registration->mutable_geometry() = rank->geometry.ToProto();
  registration->set_tp_group(rank->tp_group);
  *peer_hello->mutable_session() = hello;
  peer_hello->set_streamer_instance_id(options.streamer_instance_id);
  if (!applier->Write(message)) {
    applier->Stop();
    return absl::UnavailableError(
        absl::StrCat("the deciding streamer at ", options.decider_address, " (--decider_address) is not reachable"));
  }
  applier->reader_ = std::thread([self] { self->ReadOrders(); });
  spdlog::info("rank {} of tensor-parallel group {}: linked to the deciding streamer at {}", rank->rank,
               rank->tp_group, options.decider_address);
  return applier;
}

RankApplier::RankApplier(std::shared_ptr<RegisteredWorker> rank, std::function<void()> end_session)
    : rank_(std::move(rank)), end_session_(std::move(end_session)) {}

RankApplier::~RankApplier() { Stop(); }

bool RankApplier::Write(const nq::v1::PeerRankMessage& message) {
  absl::MutexLock lock(&write_mu_);
  if (closed_ || stream_ == nullptr) return false;
  if (!stream_->Write(message)) {
    closed_ = true;
    return false;
  }
  return true;
}

void RankApplier::ForwardUnmapAck(const nq::v1::UnmapAck& ack) {
  nq::v1::PeerRankMessage message;
  *message.mutable_unmap_ack() = ack;
  if (!Write(message)) {
    // The link is gone: the session ends with it, and the decider re-forms the group.
    spdlog::warn("rank {}: unmap acknowledgement of generation {} not forwarded, the link to the decider is gone",
                 rank_->rank, ack.generation());
  }
}

void RankApplier::ReadOrders() {
  nq::v1::DeciderMessage message;
  while (stream_->Read(&message)) {
    if (message.has_order()) {
      runner_->Order(std::move(*message.mutable_order()));
    } else {
      spdlog::warn("rank {}: unexpected message {} from the decider; ignored", rank_->rank,
                   static_cast<int>(message.message_case()));
    }
  }
  {
    // No write may overlap Finish, and none comes after it.
    absl::MutexLock lock(&write_mu_);
    closed_ = true;
  }
  const grpc::Status status = stream_->Finish();
  if (stopping_) return;
  spdlog::warn("rank {} of tensor-parallel group {}: the link to the deciding streamer ended ({}: {}); its session "
               "ends so the group re-forms",
               rank_->rank, rank_->tp_group, static_cast<int>(status.error_code()), status.error_message());
  // Stop the runner first: whatever the worker does next, nothing of ours writes its arena.
  runner_->Stop();
  if (end_session_) end_session_();
}

void RankApplier::Stop() {
  stopping_ = true;
  context_.TryCancel();
  if (reader_.joinable()) reader_.join();
  if (runner_ != nullptr) runner_->Stop();
}

}  // namespace nq::streamer
