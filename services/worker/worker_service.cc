#include "services/worker/worker_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace nq::worker {

WorkerService::WorkerService(WorkerIdentity identity, const SlotTable* table)
    : identity_(std::move(identity)), table_(table) {}

void WorkerService::SetReady() {
  absl::MutexLock lock(&mu_);
  if (state_ != nq::v1::WORKER_STATE_LOADING) return;
  state_ = nq::v1::WORKER_STATE_READY;
  ready_unix_ = std::chrono::duration_cast<std::chrono::seconds>(
                    std::chrono::system_clock::now().time_since_epoch())
                    .count();
}

void WorkerService::SetDraining() {
  absl::MutexLock lock(&mu_);
  state_ = nq::v1::WORKER_STATE_DRAINING;
}

nq::v1::WorkerState WorkerService::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

grpc::Status WorkerService::Generate(grpc::ServerContext* context,
                                     const nq::v1::WorkerGenerateRequest* request,
                                     grpc::ServerWriter<nq::v1::WorkerGenerateResponse>* writer) {
  if (state() != nq::v1::WORKER_STATE_READY) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is not ready (loading or draining)");
  }
  if (request->prompt_token_ids().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids is empty");
  }
  // The model graph lands with issue #3; until then this worker holds no model to run.
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      "this worker has no model loaded: model execution lands with issue #3");
}

grpc::Status WorkerService::Abort(grpc::ServerContext* context, const nq::v1::AbortRequest* request,
                                  nq::v1::AbortResponse* response) {
  // No sequence can be running (Generate does not start one yet), so there is nothing to abort.
  return grpc::Status(grpc::StatusCode::NOT_FOUND,
                      absl::StrCat("no running sequence with request_id '", request->request_id(), "'"));
}

grpc::Status WorkerService::GetInfo(grpc::ServerContext* context,
                                    const nq::v1::GetInfoRequest* request,
                                    nq::v1::WorkerInfo* response) {
  {
    absl::MutexLock lock(&mu_);
    response->set_state(state_);
    response->set_ready_unix(ready_unix_);
  }
  response->set_backend(identity_.backend);
  response->set_tensor_parallel_size(identity_.world_size);
  response->set_streamer_connected(streamer_connected_.load());
  const SlotGeometry& geometry = table_->geometry();
  response->set_num_moe_layers(static_cast<uint32_t>(geometry.moe_layer_ids.size()));
  response->set_slots_per_layer(geometry.slots_per_layer);
  response->set_rec_bytes(geometry.rec_bytes);
  return grpc::Status::OK;
}

}  // namespace nq::worker
