#include "services/router/generator.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"
#include "services/router/stop_matcher.h"
#include "services/tokenizer/stream_detokenizer.h"

namespace nq::router {
namespace {

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

const char* FinishName(nq::v1::FinishReason reason) {
  switch (reason) {
    case nq::v1::FINISH_REASON_STOP: return "stop";
    case nq::v1::FINISH_REASON_LENGTH: return "length";
    case nq::v1::FINISH_REASON_ABORT: return "abort";
    case nq::v1::FINISH_REASON_TOOL_CALLS: return "tool_calls";
    default: return "error";
  }
}

}  // namespace

Generator::Generator(WorkerConnection* worker, const tokenizer::Tokenizer* tokenizer, Scheduler* scheduler,
                     GenerationLimits limits, metrics::Registry& m)
    : worker_(worker),
      tokenizer_(tokenizer),
      scheduler_(scheduler),
      limits_(limits),
      ttft_(m.Histogram("nq_time_to_first_token_seconds", "Time from arrival to the first generated token",
                        metrics::ExponentialBuckets(0.005, 2, 16)).Get()),
      inter_token_(m.Histogram("nq_inter_token_latency_seconds", "Time between consecutive generated tokens",
                               metrics::ExponentialBuckets(0.001, 2, 16)).Get()),
      e2e_(m.Histogram("nq_e2e_request_latency_seconds", "Time from arrival to the last token",
                       metrics::ExponentialBuckets(0.01, 2, 16)).Get()),
      prompt_tokens_(m.Counter("nq_prompt_tokens_total", "Prompt tokens of finished requests").Get()),
      generation_tokens_(m.Counter("nq_generation_tokens_total", "Tokens generated").Get()),
      success_(m.Counter("nq_request_success_total", "Requests that finished, by finish reason",
                         {"finished_reason"})),
      invalid_utf8_(m.Counter("nq_detokenize_invalid_utf8_total",
                              "Invalid UTF-8 sequences the model produced (emitted as U+FFFD)").Get()),
      unknown_tokens_(m.Counter("nq_detokenize_unknown_tokens_total",
                                "Generated token ids the tokenizer has no text for (emitted as nothing)").Get()) {}

absl::Status Generator::Validate(GenerationRequest& request) const {
  nq::v1::SamplingParams* sampling = &request.sampling;
  if (request.prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  std::optional<nq::v1::WorkerInfo> info = worker_->info();
  if (!worker_->ready() || !info.has_value()) {
    return absl::UnavailableError("no worker is ready to serve; retry later");
  }
  const uint32_t max_len = info->max_model_len();
  if (request.prompt.size() >= max_len) {
    return absl::InvalidArgumentError(absl::StrCat("the prompt has ", request.prompt.size(),
                                                   " tokens; the model's context window is ", max_len));
  }
  if (sampling->max_tokens() > limits_.max_tokens_limit) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens ", sampling->max_tokens(),
                                                   " exceeds this server's limit of ", limits_.max_tokens_limit));
  }
  if (sampling->max_tokens() == 0) sampling->set_max_tokens(limits_.default_max_tokens);
  const uint32_t room = max_len - static_cast<uint32_t>(request.prompt.size());
  if (sampling->max_tokens() > room) sampling->set_max_tokens(room);
  for (const auto& [id, bias] : sampling->logit_bias()) {
    if (id >= info->vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias token id ", id, " is outside the vocabulary of ",
                                                     info->vocab_size()));
    }
  }
  for (int32_t id : request.prompt) {
    if (id < 0 || static_cast<uint32_t>(id) >= info->vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", id, " is outside the vocabulary of ",
                                                     info->vocab_size()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Generation>> Generator::Start(GenerationRequest request,
                                                             const std::function<bool()>& cancelled) {
  const auto arrived = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(Validate(request));
  ASSIGN_OR_RETURN(Scheduler::Slot slot, scheduler_->Admit(cancelled, request.deadline));
  return std::unique_ptr<Generation>(new Generation(this, std::move(request), std::move(slot), arrived));
}

absl::StatusOr<GenerationOutcome> Generator::Generate(GenerationRequest request,
                                                      const std::function<bool(const GenerationDelta&)>& on_delta,
                                                      const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(std::unique_ptr<Generation> generation, Start(std::move(request), cancelled));
  return generation->Run(on_delta, cancelled);
}

absl::StatusOr<GenerationOutcome> Generation::Run(const std::function<bool(const GenerationDelta&)>& on_delta,
                                                  const std::function<bool()>& cancelled) {
  Generator& g = *generator_;
  const GenerationRequest& request = request_;
  const nq::v1::SamplingParams& sampling = request.sampling;
  const auto arrived = arrived_;
  nq::v1::WorkerGenerateRequest worker_request;
  worker_request.set_request_id(request.request_id);
  worker_request.mutable_prompt_token_ids()->Add(request.prompt.begin(), request.prompt.end());
  *worker_request.mutable_sampling() = sampling;
  worker_request.mutable_sampling()->clear_stop();
  grpc::ClientContext context;
  if (request.deadline != std::chrono::steady_clock::time_point::max()) {
    context.set_deadline(std::chrono::system_clock::now() + (request.deadline - std::chrono::steady_clock::now()));
  }
  std::unique_ptr<grpc::ClientReader<nq::v1::WorkerGenerateResponse>> stream =
      g.worker_->stub()->Generate(&context, worker_request);

  tokenizer::StreamDetokenizer detokenizer(
      *g.tokenizer_, tokenizer::StreamDetokenizer::Options{.skip_special_tokens = true, .invalid_utf8_counter = &g.invalid_utf8_});
  StopMatcher stops(std::vector<std::string>(sampling.stop().begin(), sampling.stop().end()));
  GenerationOutcome outcome;
  uint32_t generated = 0;
  auto last_token_at = arrived;
  bool client_gone = false;
  nq::v1::WorkerGenerateResponse response;
  while (stream->Read(&response)) {
    GenerationDelta delta;
    for (const nq::v1::TokenLogprob& token : response.tokens()) {
      const auto now = std::chrono::steady_clock::now();
      (generated == 0 ? g.ttft_ : g.inter_token_).Observe(Seconds(now - (generated == 0 ? arrived : last_token_at)));
      last_token_at = now;
      ++generated;
      absl::StatusOr<std::string> text = detokenizer.Feed(static_cast<int32_t>(token.token_id()));
      if (!text.ok()) {
        // A model whose vocabulary is wider than its tokenizer's (DeepSeek-V3 pads to 129280
        // rows for 128815 tokens) can sample an id with no text: it is counted and emits
        // nothing rather than failing the request.
        g.unknown_tokens_.Increment();
        static LogRateLimiter limiter(std::chrono::seconds(10));
        if (long n = limiter.Allow()) spdlog::warn("token {} has no text in the tokenizer ({} times)", token.token_id(), n);
        text = std::string();
      }
      delta.text += stops.Feed(*text);
      delta.tokens.push_back(token);
      if (stops.matched()) break;
    }
    if (response.finish_reason() != nq::v1::FINISH_REASON_UNSPECIFIED) {
      outcome.finish = response.finish_reason();
      outcome.usage = response.usage();
    }
    if (stops.matched()) {
      outcome.finish = nq::v1::FINISH_REASON_STOP;
      outcome.matched_stop = stops.matched_stop();
    } else if (outcome.finish != nq::v1::FINISH_REASON_UNSPECIFIED) {
      // The end: release what the detokenizer and the stop matcher still hold.
      delta.text += stops.Feed(detokenizer.Flush());
      delta.text += stops.Flush();
    }
    if ((!delta.text.empty() || !delta.tokens.empty()) && !on_delta(delta)) client_gone = true;
    if (client_gone || cancelled()) {
      outcome.finish = nq::v1::FINISH_REASON_ABORT;
      context.TryCancel();
      break;
    }
    if (stops.matched()) {
      context.TryCancel();
      break;
    }
  }
  grpc::Status status = stream->Finish();
  if (outcome.finish == nq::v1::FINISH_REASON_UNSPECIFIED) {
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::DeadlineExceededError("the request's deadline passed during generation");
    }
    return status.ok() ? absl::InternalError("the worker ended the stream without a finish reason")
                       : Annotate(FromGrpcStatus(status), "worker");
  }
  outcome.usage.set_prompt_tokens(static_cast<uint32_t>(request.prompt.size()));
  outcome.usage.set_completion_tokens(generated);
  g.prompt_tokens_.Increment(static_cast<double>(request.prompt.size()));
  g.generation_tokens_.Increment(generated);
  g.success_.WithLabels({FinishName(outcome.finish)}).Increment();
  g.e2e_.Observe(Seconds(std::chrono::steady_clock::now() - arrived));
  return outcome;
}

}  // namespace nq::router
