// Runs one sequence on the leader worker: reuse the longest common prefix of the previous
// sequence's KV cache, prefill the rest of the prompt, then decode and sample until a stop
// token, max_tokens, the context window, or cancellation.
//
// With a drafter (speculative decoding, DESIGN.md section 3) each decode step runs the last
// token and up to N drafts through the main model in one forward, verifies the drafts in order
// (Sampler::Verify), keeps the accepted prefix plus one token of the target's, and rolls the KV
// cache back past it. The emitted tokens are those plain decoding emits: the same ones for a
// greedy request (the CPU backend's rows do not depend on how many share a forward), the same
// distribution otherwise; a stop token or max_tokens inside an accepted run ends it there.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "nq/v1/sampling.pb.h"
#include "services/model/model.h"
#include "services/worker/drafter.h"
#include "services/worker/sampler.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/step_command.h"

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
  double draft_seconds = 0;           // of `seconds`, the drafter's (0: it did not run)
  int drafts = 0;    // drafts this step verified (0: a prefill, or speculation off)
  int accepted = 0;  // of those, the accepted prefix (drafts[0, accepted) were kept)
};

// How a prompt's new tokens are prefilled (issue #23).
struct PrefillOptions {
  // Tokens per prefill forward (token order) and per chunk of a layer-major prefill: bounds a
  // prefill's activations, and a cancelled request stops within one chunk. vLLM's default
  // max_num_batched_tokens for chunked prefill.
  int64_t chunk_tokens = 2048;
  // A span of new tokens at least this long prefills layer-major (Model::PrefillLayerMajor),
  // so each layer's routed experts can run at 4 bits for the whole span; 0: never.
  int64_t layer_major_min_tokens = 0;
  // Layer-major only: called before each MoE layer (LayerMajorOptions::before_moe), and around
  // the prefill: begin with the span's length, end once it stopped (done, failed or
  // cancelled). Each may be empty.
  std::function<absl::StatusOr<std::optional<model::Model::PrefillLayerSlots>>(int64_t,
                                                                              std::span<const model::MoeRouting>)>
      before_moe;
  std::function<void(int64_t span_tokens)> begin_layer_major;
  std::function<void()> end_layer_major;

  // INVALID_ARGUMENT naming the flag for chunk_tokens <= 0 or a negative
  // layer_major_min_tokens.
  absl::Status Validate() const;
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
  // INVALID_ARGUMENT for chunk_tokens <= 0 or a negative layer_major_min_tokens. Before Run.
  absl::Status SetPrefillOptions(PrefillOptions options);
  // Each forward becomes one step of `slots` (updates applied only between steps); null:
  // no slots.
  void SetSlotRuntime(SlotRuntime* slots) { slots_ = slots; }
  // Speculative decoding with up to `num_drafts` drafts per step from `drafter` (which must
  // outlive the runner); null or 0 turns it off.
  void SetDrafter(Drafter* drafter, int num_drafts) {
    drafter_ = drafter;
    num_drafts_ = drafter != nullptr ? num_drafts : 0;
    // A tensor-parallel group's ranks run the drafter's model operations too.
    if (drafter_ != nullptr) drafter_->SetStepMirror(mirror_);
  }
  // Called after each main-model forward with how many of its leading tokens were kept: all
  // of a prefill's; of a verification, one per token it emitted (the last token and the
  // accepted drafts before the final emitted token). The rest were rolled back, so nothing
  // about them (their routing) may be reported. The cache then holds what plain decoding's
  // would: the prompt and every emitted token but the last.
  // Whether plain decode steps may sample where the logits are (Model::ForwardSampled, for
  // requests Sampler::DeviceDraw accepts, when the step runs as a graph), and greedy
  // verifications of drafts take every row's pick from there (Model::ForwardSampledRows). Off
  // until set (nq-worker's --device_sampling turns it on by default); off, every step's logits
  // come to the host and the Sampler picks (the same tokens).
  void SetDeviceSampling(bool on) { device_sampling_ = on; }
  // With device sampling, whether a plain step of a request with logit_bias or penalties (and no
  // log-probabilities) also draws on the backend, its adjustments added to the row there
  // (Sampler::DeviceDrawAdjusted, Model::ForwardSampled's logit delta). Off until set (nq-worker's
  // --device_logit_adjust turns it on by default).
  void SetDeviceLogitAdjust(bool on) { device_logit_adjust_ = on; }
  void SetKeptTokensObserver(std::function<void(int64_t kept)> observer) { kept_observer_ = std::move(observer); }
  // Tensor parallelism across processes: every cache operation and forward is first sent to
  // `mirror` (the other ranks run it on their shards); a failure to send fails the sequence.
  // Null: one rank. Speculative decoding is not mirrored (main.cc refuses both together).
  void SetStepMirror(StepMirror* mirror) {
    mirror_ = mirror;
    if (drafter_ != nullptr) drafter_->SetStepMirror(mirror);
  }
  // Forgets the cached prefix (the next prompt is computed whole) and resets the model's
  // cache, without mirroring: for a tensor-parallel group that re-formed, whose ranks start
  // with empty caches.
  void ForgetCache();

 private:
  // Tokens of the cache a prompt may keep; the runner recomputes the rest.
  size_t ReusablePrefix(const std::vector<int32_t>& prompt) const;
  absl::Status Mirror(StepCommand::Op op, int64_t position, uint64_t step, std::span<const int32_t> tokens = {});

  // Whether a span of new prompt tokens prefills layer-major.
  bool RunsLayerMajor(size_t span) const;
  // The token-order prefill of the new span but its last chunk: each chunk a slot step of its
  // own, kept as it completes (cache, cached_tokens_, kept observer, drafter), the
  // cancellation checked before each. Leaves the last chunk in `input` for the first step (a
  // layer-major span is left whole). Returns false when cancelled.
  absl::StatusOr<bool> PrefillLeadingChunks(std::vector<int32_t>& input, std::span<const int32_t> prompt,
                                            const std::function<bool()>& cancelled);
  // Feeds the drafter the prefill positions [first, first + count) whose final-normed states
  // are `hidden` (the model's last_hidden(), from its row 0: tensor-parallel followers take the
  // same rows of theirs), chunk by chunk, without drafting.
  absl::Status FeedDrafter(std::span<const int32_t> sequence, int64_t first, int64_t count,
                           std::span<const float> hidden);

  model::Model* const model_;
  bool graphs_off_logged_ = false;  // the warning that step graphs were turned off, once
  PrefillOptions prefill_;
  const std::vector<int32_t> eos_token_ids_;
  SlotRuntime* slots_ = nullptr;
  bool device_sampling_ = false;
  bool device_logit_adjust_ = false;
  Drafter* drafter_ = nullptr;
  int num_drafts_ = 0;
  std::function<void(int64_t)> kept_observer_;
  StepMirror* mirror_ = nullptr;
  uint64_t sequences_ = 0;  // sequences run (names them in step commands)
  // Tokens whose KV is in the cache, in order (the previous sequence, for prefix reuse).
  std::vector<int32_t> cached_tokens_;
};

}  // namespace nq::worker
