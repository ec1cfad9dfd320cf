// nq.v1.Streamer: worker registration and the per-worker control session.
#pragma once

#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.grpc.pb.h"
#include "services/common/internal_tls.h"
#include "services/common/metrics/registry.h"
#include "services/streamer/group_sessions.h"
#include "services/streamer/rank_applier.h"
#include "services/streamer/slot_loader.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

// Decode tokens between routing reports (DESIGN.md section 7).
inline constexpr uint32_t kReportIntervalTokens = 16;

// How this streamer takes part in tensor-parallel groups whose ranks span nodes
// (docs/tp_streamers.md).
struct StreamerPeerOptions {
  // Empty: this streamer decides for the groups whose rank 0 registers with it, and takes the
  // links of their ranks on other nodes (StreamerPeerService). Set: it applies the decisions of
  // the streamer at this host:port for every group of its ranks (none of which may be rank 0).
  std::string decider_address;
  // Mutual TLS for the link to the decider; null: plaintext.
  std::shared_ptr<const InternalTls> tls;
};

class StreamerService final : public nq::v1::Streamer::Service {
 public:
  // `loader_options`: where records come from and how to read and predict; nullopt when the
  // streamer has no release (sessions then only count reports; workers stay at 2 bits).
  // Every session reads through one RecordFiles: loader_options->files, or, when that is
  // null, one opened from record_dirs at the first session that needs it.
  StreamerService(WorkerRegistry* registry, metrics::Registry& metrics,
                  std::optional<SlotLoaderOptions> loader_options = std::nullopt, StreamerPeerOptions peer = {});

  grpc::Status RegisterWorker(grpc::ServerContext* context,
                              const nq::v1::RegisterWorkerRequest* request,
                              nq::v1::RegisterWorkerResponse* response) override;
  grpc::Status Session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream) override;

  const std::string& instance_id() const { return instance_id_; }

  // nq.v1.StreamerPeer.RankLink (served through StreamerPeerService): a rank of one of this
  // streamer's groups, served by another node's streamer, joins the group for as long as the
  // link lasts.
  grpc::Status RankLink(grpc::ServerContext* context,
                        grpc::ServerReaderWriter<nq::v1::DeciderMessage, nq::v1::PeerRankMessage>* stream);

 private:
  // loader_options_ with its shared files opened (once; a failure is retried by the next
  // session).
  absl::StatusOr<SlotLoaderOptions> LoaderOptions();
  // The session's started loader; null when there is nothing to load (no release here, or a
  // worker with static expert bits). The errors of LoaderOptions, SlotLoader::Create and
  // SlotLoader::Start.
  absl::StatusOr<std::unique_ptr<SlotLoader>> StartLoader(
      const std::shared_ptr<RegisteredWorker>& worker, const nq::v1::SessionHello& hello,
      grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream);

  // The session of one rank of a tensor-parallel group (group_sessions.h), after its hello.
  grpc::Status GroupSession(
      grpc::ServerContext* context, const std::shared_ptr<RegisteredWorker>& worker,
      const nq::v1::SessionHello& hello,
      grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream);

  // The session of one rank of a group another node's streamer decides for (rank_applier.h).
  grpc::Status AppliedGroupSession(
      grpc::ServerContext* context, const std::shared_ptr<RegisteredWorker>& worker,
      const nq::v1::SessionHello& hello,
      grpc::ServerReaderWriter<nq::v1::StreamerMessage, nq::v1::WorkerMessage>* stream);

  WorkerRegistry* const registry_;
  const StreamerPeerOptions peer_;
  absl::Mutex files_mu_;
  std::optional<SlotLoaderOptions> loader_options_ ABSL_GUARDED_BY(files_mu_);
  LoaderMetrics loader_metrics_;
  // Random per start: tells workers that the streamer restarted (see RegisterWorkerResponse).
  const std::string instance_id_;
  metrics::Gauge& sessions_active_;
  metrics::Counter& routing_reports_;
  metrics::Counter& routing_tokens_;
  metrics::Counter& unmap_acks_;
  metrics::Counter& sessions_failed_;
  metrics::Counter& lookahead_hints_;
  metrics::Counter& follower_reports_dropped_;
  GroupSessions groups_;
};

// nq.v1.StreamerPeer on the same server as nq.v1.Streamer: its links join the groups of `service`.
class StreamerPeerService final : public nq::v1::StreamerPeer::Service {
 public:
  explicit StreamerPeerService(StreamerService* service) : service_(service) {}
  grpc::Status RankLink(grpc::ServerContext* context,
                        grpc::ServerReaderWriter<nq::v1::DeciderMessage, nq::v1::PeerRankMessage>* stream) override {
    return service_->RankLink(context, stream);
  }

 private:
  StreamerService* const service_;
};

}  // namespace nq::streamer
