// The router's generation pipeline, shared by the OpenAI HTTP API and gRPC nq.v1.Inference:
// admission through the scheduler, the worker's token stream, UTF-8-safe streaming
// detokenization, stop strings, cancellation (client gone, deadline), and the request
// metrics of DESIGN.md section 8.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nq/v1/sampling.pb.h"
#include "services/common/metrics/registry.h"
#include "services/router/scheduler.h"
#include "services/router/worker_connection.h"
#include "services/tokenizer/tokenizer.h"

namespace nq::router {

struct GenerationLimits {
  uint32_t max_tokens_limit = 4096;  // largest max_tokens a request may ask for
  uint32_t default_max_tokens = 256;  // when the request sets none
};

struct GenerationRequest {
  std::string request_id;
  std::vector<int32_t> prompt;
  nq::v1::SamplingParams sampling;  // `stop` strings are handled here, the rest by the worker
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

struct GenerationDelta {
  std::string text;  // whole UTF-8 characters
  std::vector<nq::v1::TokenLogprob> tokens;
};

struct GenerationOutcome {
  nq::v1::FinishReason finish = nq::v1::FINISH_REASON_UNSPECIFIED;
  nq::v1::Usage usage;
  std::string matched_stop;
};

class Generator;

// An admitted request: it holds the worker (the scheduler's slot) until destroyed.
class Generation {
 public:
  // Streams deltas to `on_delta` (false: the client is gone, abort); `cancelled` is polled
  // between tokens. Call once.
  absl::StatusOr<GenerationOutcome> Run(const std::function<bool(const GenerationDelta&)>& on_delta,
                                        const std::function<bool()>& cancelled);

 private:
  friend class Generator;
  Generation(Generator* generator, GenerationRequest request, Scheduler::Slot slot,
             std::chrono::steady_clock::time_point arrived)
      : generator_(generator), request_(std::move(request)), slot_(std::move(slot)), arrived_(arrived) {}

  Generator* generator_;
  GenerationRequest request_;
  Scheduler::Slot slot_;
  std::chrono::steady_clock::time_point arrived_;
};

class Generator {
 public:
  Generator(WorkerConnection* worker, const tokenizer::Tokenizer* tokenizer, Scheduler* scheduler,
            GenerationLimits limits, metrics::Registry& metrics);

  // Validates and waits for the worker (in the FIFO queue). Errors: INVALID_ARGUMENT (empty
  // or too long prompt, max_tokens over the limit), RESOURCE_EXHAUSTED (queue full),
  // UNAVAILABLE (no worker), DEADLINE_EXCEEDED, CANCELLED (`cancelled` while waiting).
  absl::StatusOr<std::unique_ptr<Generation>> Start(GenerationRequest request,
                                                    const std::function<bool()>& cancelled);
  // Start + Run.
  absl::StatusOr<GenerationOutcome> Generate(GenerationRequest request,
                                             const std::function<bool(const GenerationDelta&)>& on_delta,
                                             const std::function<bool()>& cancelled);

  const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
  const GenerationLimits& limits() const { return limits_; }

 private:
  friend class Generation;
  absl::Status Validate(GenerationRequest& request) const;

  WorkerConnection* const worker_;
  const tokenizer::Tokenizer* const tokenizer_;
  Scheduler* const scheduler_;
  const GenerationLimits limits_;
  metrics::Histogram& ttft_;
  metrics::Histogram& inter_token_;
  metrics::Histogram& e2e_;
  metrics::Counter& prompt_tokens_;
  metrics::Counter& generation_tokens_;
  metrics::CounterFamily& success_;
  metrics::Counter& invalid_utf8_;
  metrics::Counter& unknown_tokens_;
};

}  // namespace nq::router
