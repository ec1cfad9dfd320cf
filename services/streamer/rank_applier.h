// One rank of a tensor-parallel group whose loader runs on another node's streamer (the decider:
// nq-streamer --decider_address, docs/tp_streamers.md). For as long as the rank's session with
// this streamer lasts, the rank is linked to the decider (StreamerPeer.RankLink): the decider's
// load orders are carried out into the rank's arena (peer_order_runner.h), their results and the
// rank's unmap acknowledgements go back. The rank's slot-table updates never pass here: rank 0
// relays them in its step commands.
//
// When the link ends (the decider refused the rank, ended the group because another rank left,
// or is gone), the rank's session is ended too (`end_session`): the worker registers again, and
// its new session opens a new link, so the group re-forms from fresh hellos on both nodes.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.grpc.pb.h"
#include "services/common/internal_tls.h"
#include "services/streamer/loader_metrics.h"
#include "services/streamer/peer_order_runner.h"
#include "services/streamer/slot_loader.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

struct RankApplierOptions {
  // host:port of the deciding streamer's gRPC (nq.v1.StreamerPeer).
  std::string decider_address;
  // Mutual TLS as between the other services; null: plaintext (loopback or allowed by flag).
  std::shared_ptr<const InternalTls> tls;
  // This streamer's instance id, for the decider's logs.
  std::string streamer_instance_id;
};

class RankApplier {
 public:
  // Checks this streamer's records for the rank (PeerOrderRunner::Create), opens the link and
  // sends the hello. The decider's answer comes asynchronously: a refusal ends the link, and so
  // the session, with the decider's reason logged here.
  static absl::StatusOr<std::unique_ptr<RankApplier>> Start(std::shared_ptr<RegisteredWorker> rank,
                                                            const nq::v1::SessionHello& hello,
                                                            const SlotLoaderOptions& loader_options,
                                                            const RankApplierOptions& options,
                                                            LoaderMetrics* metrics, std::function<void()> end_session);
  ~RankApplier();
  RankApplier(const RankApplier&) = delete;
  RankApplier& operator=(const RankApplier&) = delete;

  // The rank acknowledged unmaps: the decider reuses a slot only once every rank did.
  void ForwardUnmapAck(const nq::v1::UnmapAck& ack);
  // Ends the link and stops the runner; once it returns nothing writes the rank's arena.
  // Idempotent.
  void Stop();

 private:
  RankApplier(std::shared_ptr<RegisteredWorker> rank, std::function<void()> end_session);
  // Writes one message on the link; false once it is closed.
  bool Write(const nq::v1::PeerRankMessage& message);
  // Reads orders until the link ends; then ends the rank's session unless Stop ended the link.
  void ReadOrders();

  const std::shared_ptr<RegisteredWorker> rank_;
  const std::function<void()> end_session_;
  std::unique_ptr<nq::v1::StreamerPeer::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<nq::v1::PeerRankMessage, nq::v1::DeciderMessage>> stream_;
  std::unique_ptr<PeerOrderRunner> runner_;
  std::thread reader_;
  std::atomic<bool> stopping_{false};
  // One writer at a time on the link (the runner's answers, the session's acks); none after
  // the link closed.
  absl::Mutex write_mu_;
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
};

}  // namespace nq::streamer
