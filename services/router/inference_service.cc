#include "services/router/inference_service.h"

#include "services/common/status_grpc.h"

namespace nq::router {

absl::StatusOr<nq::v1::ModelInfo> CurrentModelInfo(const WorkerConnection& worker,
                                                   const std::string& served_model_name) {
  std::optional<nq::v1::WorkerInfo> info = worker.info();
  if (!worker.ready() || !info.has_value()) {
    return absl::UnavailableError("the leader worker at " + worker.address() + " is not ready");
  }
  nq::v1::ModelInfo model;
  model.set_id(!served_model_name.empty() ? served_model_name : info->model_id());
  model.set_architecture(info->architecture());
  model.set_vocab_size(info->vocab_size());
  model.set_max_model_len(info->max_model_len());
  model.set_tensor_parallel_size(info->tensor_parallel_size());
  model.set_release_id(info->release_id());
  model.set_num_speculative_tokens(info->num_speculative_tokens());
  model.set_created_unix(info->ready_unix());
  return model;
}

InferenceService::InferenceService(WorkerConnection* worker, std::string served_model_name)
    : worker_(worker), served_model_name_(std::move(served_model_name)) {}

grpc::Status InferenceService::Generate(grpc::ServerContext* context,
                                        const nq::v1::GenerateRequest* request,
                                        grpc::ServerWriter<nq::v1::GenerateResponse>* writer) {
  // Tokenizer, chat template and scheduling land with issue #4.
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      "Generate is not served yet: the tokenizer and scheduler land with issue #4");
}

grpc::Status InferenceService::Tokenize(grpc::ServerContext* context,
                                        const nq::v1::TokenizeRequest* request,
                                        nq::v1::TokenizeResponse* response) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      "Tokenize is not served yet: the tokenizer lands with issue #4");
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext* context,
                                            const nq::v1::GetModelInfoRequest* request,
                                            nq::v1::ModelInfo* response) {
  absl::StatusOr<nq::v1::ModelInfo> info = CurrentModelInfo(*worker_, served_model_name_);
  if (!info.ok()) return ToGrpcStatus(info.status());
  *response = *std::move(info);
  return grpc::Status::OK;
}

}  // namespace nq::router
