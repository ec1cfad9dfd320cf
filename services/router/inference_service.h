// nq.v1.Inference, the public gRPC API.
#pragma once

#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "nq/v1/inference.grpc.pb.h"
#include "services/router/api_key.h"
#include "services/router/chat_adapter.h"
#include "services/router/generator.h"
#include "services/router/worker_connection.h"

namespace nq::router {

// ModelInfo as the router reports it, from the leader worker's last GetInfo. UNAVAILABLE
// while no worker is ready.
absl::StatusOr<nq::v1::ModelInfo> CurrentModelInfo(const WorkerConnection& worker,
                                                   const std::string& served_model_name);

class InferenceService final : public nq::v1::Inference::Service {
 public:
  // `generator` and `chat` may be null (no tokenizer / no chat format): the calls that need
  // them answer UNAVAILABLE / UNIMPLEMENTED. `api_key` (null or disabled: open) is required
  // on every call, as 'authorization: Bearer <key>' metadata, the same key as the HTTP API's.
  InferenceService(WorkerConnection* worker, Generator* generator, const ChatAdapter* chat,
                   std::string served_model_name, const ApiKeyCheck* api_key = nullptr);

  grpc::Status Generate(grpc::ServerContext* context, const nq::v1::GenerateRequest* request,
                        grpc::ServerWriter<nq::v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const nq::v1::TokenizeRequest* request,
                        nq::v1::TokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const nq::v1::GetModelInfoRequest* request,
                            nq::v1::ModelInfo* response) override;

 private:
  absl::StatusOr<std::vector<int32_t>> PromptIds(const nq::v1::GenerateRequest& request) const;
  // UNAUTHENTICATED unless the call carries the API key (when one is set).
  absl::Status Authorize(const grpc::ServerContext& context) const;

  WorkerConnection* const worker_;
  Generator* const generator_;
  const ChatAdapter* const chat_;
  const std::string served_model_name_;
  const ApiKeyCheck* const api_key_;
};

}  // namespace nq::router
