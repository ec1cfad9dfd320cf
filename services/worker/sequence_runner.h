// Runs one sequence on the leader worker: reuse the longest common prefix of the previous
// sequence's KV cache, prefill the rest of the prompt, then decode and sample token by token
// until a stop token, max_tokens, the context window, or cancellation.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "nq/v1/sampling.pb.h"
#include "services/model/model.h"
#include "services/worker/sampler.h"
#include "services/worker/slot_runtime.h"

namespace nq::worker {

struct SequenceRequest {
  std::vector<int32_t> prompt;
  SamplingConfig sampling;
  uint32_t max_tokens = 0;  // 0: up to the context window
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

struct SequenceStep {
  std::vector<SampledToken> tokens;  // accepted this step
  nq::v1::FinishReason finish = nq::v1::FINISH_REASON_UNSPECIFIED;
  double seconds = 0;                 // time of this step (prefill for the first)
};

struct SequenceStats {
  uint32_t prompt_tokens = 0;
  uint32_t cached_prompt_tokens = 0;
  uint32_t completion_tokens = 0;
};

class SequenceRunner {
 public:
  SequenceRunner(model::Model* model, std::vector<int32_t> eos_token_ids)
      : model_(model), eos_token_ids_(std::move(eos_token_ids)) {}

  // Calls `emit` after every step (the last one carries the finish reason). `emit` returning
  // false, or `cancelled()` turning true between steps, ends the sequence with
  // FINISH_REASON_ABORT. INVALID_ARGUMENT for an empty prompt, a token id out of the
  // vocabulary, or a prompt that fills the context window.
  absl::StatusOr<SequenceStats> Run(const SequenceRequest& request,
                                    const std::function<bool(const SequenceStep&)>& emit,
                                    const std::function<bool()>& cancelled);

  int64_t context_window() const;
  // Each forward becomes one step of `slots` (updates applied only between steps); null:
  // no slots.
  void SetSlotRuntime(SlotRuntime* slots) { slots_ = slots; }

 private:
  model::Model* const model_;
  const std::vector<int32_t> eos_token_ids_;
  SlotRuntime* slots_ = nullptr;
  // Tokens whose KV is in the cache, in order (the previous sequence, for prefix reuse).
  std::vector<int32_t> cached_tokens_;
};

}  // namespace nq::worker
