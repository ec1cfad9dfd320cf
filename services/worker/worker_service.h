// nq.v1.Worker, served by the leader rank to the router.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "nq/v1/worker.grpc.pb.h"
#include "services/common/metrics/registry.h"
#include "services/model/model.h"
#include "services/worker/mtp_drafter.h"
#include "services/worker/lookahead_reporter.h"
#include "services/worker/routing_watchers.h"
#include "services/worker/sequence_runner.h"
#include "services/worker/spec_decode_metrics.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/tp_leader.h"

namespace nq::worker {

struct WorkerIdentity {
  std::string backend;  // "cpu" or "cuda"
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string model_id;  // served model name (the model directory's name by default)
  // The NestQuant release the routed experts come from (format::Release::id(), the manifest's
  // identity), whatever --expert_bits; empty when they are the checkpoint's own weights.
  std::string release_id;
};

class WorkerService final : public nq::v1::Worker::Service {
 public:
  // `model` may be null (no model loaded): Generate is then UNAVAILABLE.
  WorkerService(WorkerIdentity identity, SlotRuntime* slots, model::Model* model);

  // Speculative decoding with `num_drafts` MTP drafts per step (0: off). FAILED_PRECONDITION
  // when the model has no MTP layer; INVALID_ARGUMENT for a negative count. Before serving.
  absl::Status EnableSpeculation(int num_drafts);

  // How prompts are prefilled (chunk size, layer-major threshold and hooks). INVALID_ARGUMENT
  // as SequenceRunner::SetPrefillOptions. Before serving.
  absl::Status SetPrefillOptions(PrefillOptions options);

  // Life-cycle transitions, driven by main(): LOADING -> READY -> DRAINING.
  void SetReady();
  void SetDraining();
  void SetStreamerConnected(bool connected) { streamer_connected_ = connected; }
  // Where routing reports go (the streamer client's queue): every kReportInterval tokens the
  // worker sends the (layer, experts, weights) of each token it ran. Set before serving.
  void SetRoutingSink(std::function<void(nq::v1::RoutingReport)> sink) { routing_sink_ = std::move(sink); }
  // --device_sampling (SequenceRunner::SetDeviceSampling), which also has greedy MTP drafts
  // drawn on the backend (MtpDrafter::SetDraftOnDevice).
  void SetDeviceSampling(bool on);
  // --device_logit_adjust (SequenceRunner::SetDeviceLogitAdjust).
  void SetDeviceLogitAdjust(bool on);
  // Rank 0 of a tensor-parallel group of processes: each sequence holds `leader`'s group and
  // mirrors its steps to the other ranks; UNAVAILABLE while the group is not formed. Set
  // before serving; `leader` outlives the service.
  void SetTensorParallelLeader(TpLeader* leader);
  // Gate lookahead (issue #21, lookahead_reporter.h): during decode steps, layer L + depth's
  // predicted experts go to `sink` as soon as layer L ran. depth 0 leaves it off. Before serving.
  // INVALID_ARGUMENT for a negative depth, no model, or a depth no MoE layer is that far ahead for.
  absl::Status EnableLookahead(int depth, LookaheadReporter::Sink sink);
  nq::v1::WorkerState state() const;

  grpc::Status Generate(grpc::ServerContext* context, const nq::v1::WorkerGenerateRequest* request,
                        grpc::ServerWriter<nq::v1::WorkerGenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const nq::v1::AbortRequest* request,
                     nq::v1::AbortResponse* response) override;
  grpc::Status GetInfo(grpc::ServerContext* context, const nq::v1::GetInfoRequest* request,
                       nq::v1::WorkerInfo* response) override;
  grpc::Status WatchRouting(grpc::ServerContext* context, const nq::v1::WatchRoutingRequest* request,
                            grpc::ServerWriter<nq::v1::RoutingReport>* writer) override;

 private:
  const WorkerIdentity identity_;
  SlotRuntime* const slots_;
  model::Model* const model_;
  std::unique_ptr<SequenceRunner> runner_;
  TpLeader* tp_leader_ = nullptr;
  // Routing of the tokens since the last report (decode thread only). A forward's routing
  // waits in forward_routing_ until the runner says how many of its tokens were kept
  // (OnKeptTokens): rejected drafts were never part of the sequence and are not reported.
  void OnRouting(int64_t layer, const model::MoeRouting& routing);
  void OnKeptTokens(int64_t kept);
  // Sends pending_ to the streamer's queue and the watchers, and clears it.
  void EmitPendingRouting();
  RoutingWatchers watchers_;
  std::function<void(nq::v1::RoutingReport)> routing_sink_;
  std::vector<uint32_t> moe_layers_;               // main-model MoE layers, in order
  std::vector<model::MoeRouting> forward_routing_;  // this forward, one entry per MoE layer
  std::unique_ptr<MtpDrafter> drafter_;
  int num_drafts_ = 0;
  std::unique_ptr<LookaheadReporter> lookahead_;
  int64_t last_lookahead_target_ = -1;  // a prediction for a layer at or below it starts a forward
  bool device_sampling_ = false;
  std::unique_ptr<SpecDecodeMetrics> spec_metrics_;
  metrics::HistogramFamily& step_seconds_;
  // nq_worker_step_graphs_total{event}: forwards by how their step graph ran
  // (Model::StepGraphStats), each child looked up once; and the counts reported so far.
  metrics::Counter& graph_warmups_;
  metrics::Counter& graph_captures_;
  metrics::Counter& graph_replays_;
  metrics::Gauge& graphs_off_;  // nq_worker_step_graphs_off
  model::Model::StepGraphStats graphs_reported_;
  void ReportStepGraphs();
  nq::v1::RoutingReport pending_;                   // tokens not yet reported
  uint64_t sequence_id_ = 0;
  uint64_t sequence_tokens_ = 0;
  // Held for the whole of a sequence: the worker runs one at a time (the router queues).
  absl::Mutex run_mu_;
  // The running sequence, for Abort.
  std::string running_request_id_ ABSL_GUARDED_BY(mu_);
  bool abort_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> streamer_connected_{false};
  mutable absl::Mutex mu_;
  nq::v1::WorkerState state_ ABSL_GUARDED_BY(mu_) = nq::v1::WORKER_STATE_LOADING;
  int64_t ready_unix_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace nq::worker
