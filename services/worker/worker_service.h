// nq.v1.Worker, served by the leader rank to the router.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "nq/v1/worker.grpc.pb.h"
#include "services/worker/slot_table.h"

namespace nq::worker {

struct WorkerIdentity {
  std::string backend;  // "cpu" or "cuda"
  uint32_t rank = 0;
  uint32_t world_size = 1;
};

class WorkerService final : public nq::v1::Worker::Service {
 public:
  WorkerService(WorkerIdentity identity, const SlotTable* table);

  // Life-cycle transitions, driven by main(): LOADING -> READY -> DRAINING.
  void SetReady();
  void SetDraining();
  void SetStreamerConnected(bool connected) { streamer_connected_ = connected; }
  nq::v1::WorkerState state() const;

  grpc::Status Generate(grpc::ServerContext* context, const nq::v1::WorkerGenerateRequest* request,
                        grpc::ServerWriter<nq::v1::WorkerGenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const nq::v1::AbortRequest* request,
                     nq::v1::AbortResponse* response) override;
  grpc::Status GetInfo(grpc::ServerContext* context, const nq::v1::GetInfoRequest* request,
                       nq::v1::WorkerInfo* response) override;

 private:
  const WorkerIdentity identity_;
  const SlotTable* const table_;
  std::atomic<bool> streamer_connected_{false};
  mutable absl::Mutex mu_;
  nq::v1::WorkerState state_ ABSL_GUARDED_BY(mu_) = nq::v1::WORKER_STATE_LOADING;
  int64_t ready_unix_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace nq::worker
