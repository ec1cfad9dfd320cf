#include "services/router/inference_service.h"

#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"

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

InferenceService::InferenceService(WorkerConnection* worker, Generator* generator, const ChatAdapter* chat,
                                   std::string served_model_name, const ApiKeyCheck* api_key)
    : worker_(worker),
      generator_(generator),
      chat_(chat),
      served_model_name_(std::move(served_model_name)),
      api_key_(api_key) {}

absl::Status InferenceService::Authorize(const grpc::ServerContext& context) const {
  if (api_key_ == nullptr || !api_key_->enabled()) return absl::OkStatus();
  // gRPC metadata keys are lower-case; a repeated key counts as missing rather than guessed at.
  const auto& metadata = context.client_metadata();
  if (metadata.count("authorization") != 1) return api_key_->Check("");
  const grpc::string_ref value = metadata.find("authorization")->second;
  return api_key_->Check(std::string(value.data(), value.size()));
}

absl::StatusOr<std::vector<int32_t>> InferenceService::PromptIds(const nq::v1::GenerateRequest& request) const {
  switch (request.input_case()) {
    case nq::v1::GenerateRequest::kPrompt:
      return generator_->tokenizer().Encode(request.prompt(), /*add_special_tokens=*/true);
    case nq::v1::GenerateRequest::kChat: {
      if (chat_ == nullptr) return absl::UnimplementedError("this model has no chat format configured");
      ASSIGN_OR_RETURN(std::string text, chat_->Render(request.chat()));
      return generator_->tokenizer().Encode(text, /*add_special_tokens=*/false);
    }
    case nq::v1::GenerateRequest::kPromptTokenIds:
      return std::vector<int32_t>(request.prompt_token_ids().ids().begin(), request.prompt_token_ids().ids().end());
    default:
      return absl::InvalidArgumentError("set one of prompt, chat or prompt_token_ids");
  }
}

grpc::Status InferenceService::Generate(grpc::ServerContext* context, const nq::v1::GenerateRequest* request,
                                        grpc::ServerWriter<nq::v1::GenerateResponse>* writer) {
  if (absl::Status s = Authorize(*context); !s.ok()) return ToGrpcStatus(s);
  if (generator_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this router has no tokenizer loaded (--tokenizer)");
  }
  absl::StatusOr<nq::v1::ModelInfo> info = CurrentModelInfo(*worker_, served_model_name_);
  if (!request->model().empty() && info.ok() && request->model() != info->id()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "the model '" + request->model() + "' does not exist; this server serves '" + info->id() + "'");
  }
  absl::StatusOr<std::vector<int32_t>> prompt = PromptIds(*request);
  if (!prompt.ok()) return ToGrpcStatus(prompt.status());
  GenerationRequest generation;
  generation.request_id = request->request_id().empty() ? "grpc-" + std::to_string(reinterpret_cast<uintptr_t>(context))
                                                        : request->request_id();
  generation.prompt = *std::move(prompt);
  generation.sampling = request->sampling();
  if (context->deadline() != std::chrono::system_clock::time_point::max()) {
    generation.deadline = std::chrono::steady_clock::now() + (context->deadline() - std::chrono::system_clock::now());
  }
  std::unique_ptr<ChatStreamParser> parser;
  if (request->input_case() == nq::v1::GenerateRequest::kChat) parser = chat_->NewParser(request->chat());
  const std::string id = generation.request_id;
  auto cancelled = [context] { return context->IsCancelled(); };
  absl::StatusOr<GenerationOutcome> outcome = generator_->Generate(
      std::move(generation),
      [&](const GenerationDelta& delta) {
        nq::v1::GenerateResponse response;
        response.set_request_id(id);
        if (parser != nullptr) {
          ChatDelta split = parser->Feed(delta.text);
          response.set_text(split.content);
          response.set_reasoning_text(split.reasoning);
        } else {
          response.set_text(delta.text);
        }
        if (request->return_tokens()) {
          for (const nq::v1::TokenLogprob& token : delta.tokens) *response.add_tokens() = token;
        }
        return writer->Write(response);
      },
      cancelled);
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  nq::v1::GenerateResponse last;
  last.set_request_id(id);
  last.set_finish_reason(outcome->finish);
  *last.mutable_usage() = outcome->usage;
  last.set_matched_stop(outcome->matched_stop);
  if (parser != nullptr) {
    ChatDelta rest = parser->Finish();
    last.set_text(rest.content);
    last.set_reasoning_text(rest.reasoning);
    for (const nq::v1::ToolCall& call : parser->Result().tool_calls) *last.add_tool_calls() = call;
    if (last.tool_calls_size() > 0 && outcome->finish == nq::v1::FINISH_REASON_STOP) {
      last.set_finish_reason(nq::v1::FINISH_REASON_TOOL_CALLS);
    }
  }
  writer->Write(last);
  return grpc::Status::OK;
}

grpc::Status InferenceService::Tokenize(grpc::ServerContext* context, const nq::v1::TokenizeRequest* request,
                                        nq::v1::TokenizeResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return ToGrpcStatus(s);
  if (generator_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this router has no tokenizer loaded (--tokenizer)");
  }
  absl::StatusOr<std::vector<int32_t>> ids;
  if (request->input_case() == nq::v1::TokenizeRequest::kChat) {
    if (chat_ == nullptr) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no chat format configured");
    absl::StatusOr<std::string> text = chat_->Render(request->chat());
    if (!text.ok()) return ToGrpcStatus(text.status());
    ids = generator_->tokenizer().Encode(*text, false);
  } else {
    ids = generator_->tokenizer().Encode(request->text(), request->add_special_tokens());
  }
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  for (int32_t id : *ids) {
    response->add_ids(static_cast<uint32_t>(id));
    response->add_tokens(generator_->tokenizer().IdToToken(id).value_or(""));
  }
  std::optional<nq::v1::WorkerInfo> info = worker_->info();
  if (info.has_value()) response->set_max_model_len(info->max_model_len());
  return grpc::Status::OK;
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext* context,
                                            const nq::v1::GetModelInfoRequest* request,
                                            nq::v1::ModelInfo* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<nq::v1::ModelInfo> info = CurrentModelInfo(*worker_, served_model_name_);
  if (!info.ok()) return ToGrpcStatus(info.status());
  *response = *std::move(info);
  return grpc::Status::OK;
}

}  // namespace nq::router
