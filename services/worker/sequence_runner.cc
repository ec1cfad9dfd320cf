#include "services/worker/sequence_runner.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/elapsed.h"
#include "services/common/status_macros.h"

namespace nq::worker {

int64_t SequenceRunner::context_window() const { return model_->max_tokens(); }

absl::Status PrefillOptions::Validate() const {
  if (chunk_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill_chunk_tokens=", chunk_tokens, ": a prefill chunk needs at least one token"));
  }
  if (layer_major_min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layer_major_prefill_tokens=", layer_major_min_tokens, ": want 0 (off) or a span length"));
  }
  return absl::OkStatus();
}

absl::Status SequenceRunner::SetPrefillOptions(PrefillOptions options) {
  RETURN_IF_ERROR(options.Validate());
  prefill_ = std::move(options);
  return absl::OkStatus();
}

absl::Status SequenceRunner::FeedDrafter(std::span<const int32_t> sequence, int64_t first, int64_t count,
                                         std::span<const float> hidden) {
  const int64_t D = model_->config().hidden_size, C = prefill_.chunk_tokens;
  for (int64_t fed = 0; fed < count; fed += C) {
    const int64_t n = std::min(C, count - fed);
    RETURN_IF_ERROR(drafter_
                        ->Propose(DraftRequest{
                            .sequence = sequence,
                            .first_position = first + fed,
                            .kept = n,
                            .hidden = hidden.subspan(static_cast<size_t>(fed * D), static_cast<size_t>(n * D)),
                            .hidden_row = fed,
                            .num_drafts = 0,
                        })
                        .status());
  }
  return absl::OkStatus();
}

bool SequenceRunner::RunsLayerMajor(size_t span) const {
  return mirror_ == nullptr && prefill_.layer_major_min_tokens > 0 &&
         static_cast<int64_t>(span) >= prefill_.layer_major_min_tokens;
}

absl::StatusOr<bool> SequenceRunner::PrefillLeadingChunks(std::vector<int32_t>& input,
                                                          std::span<const int32_t> prompt,
                                                          const std::function<bool()>& cancelled) {
  if (RunsLayerMajor(input.size())) return true;  // the first step runs the whole span
  const size_t C = static_cast<size_t>(prefill_.chunk_tokens);
  size_t done = 0;
  bool completed = true;
  while (input.size() - done > C) {
    if (cancelled()) {
      completed = false;
      break;
    }
    const std::span<const int32_t> chunk = std::span<const int32_t>(input).subspan(done, C);
    const int64_t first = model_->cache_length();
    // The step begins before the command goes out: the slot updates it applies ride along, so
    // the other ranks run this chunk with the same table.
    if (slots_ != nullptr) slots_->BeginStep(0);
    absl::Status status = Mirror(StepCommand::Op::kForwardLast, first, 0, chunk);
    if (status.ok()) status = model_->ForwardLast(chunk).status();
    if (slots_ != nullptr) slots_->EndStep();
    RETURN_IF_ERROR(status);
    cached_tokens_.insert(cached_tokens_.end(), chunk.begin(), chunk.end());
    if (kept_observer_) kept_observer_(static_cast<int64_t>(C));
    if (num_drafts_ > 0) RETURN_IF_ERROR(FeedDrafter(prompt, first, static_cast<int64_t>(C), model_->last_hidden()));
    done += C;
  }
  input.erase(input.begin(), input.begin() + static_cast<std::ptrdiff_t>(done));
  return completed;
}

void SequenceRunner::ForgetCache() {
  model_->ResetCache();
  cached_tokens_.clear();
}

absl::Status SequenceRunner::Mirror(StepCommand::Op op, int64_t position, uint64_t step,
                                    std::span<const int32_t> tokens) {
  if (mirror_ == nullptr) return absl::OkStatus();
  StepCommand command{.op = op, .position = position, .sequence = sequences_, .step = step};
  command.tokens.assign(tokens.begin(), tokens.end());
  // The slot updates this rank applied at this step's start (a group's leader applies only
  // there): every rank applies them before running the command.
  if (slots_ != nullptr) command.slot_updates = slots_->TakeRelayed();
  return mirror_->Mirror(command);
}

size_t SequenceRunner::ReusablePrefix(const std::vector<int32_t>& prompt) const {
  size_t common = 0;
  while (common < cached_tokens_.size() && common < prompt.size() && cached_tokens_[common] == prompt[common]) {
    ++common;
  }
  // At least the last prompt token is recomputed so there are logits to sample from.
  size_t reuse = std::min(common, prompt.size() - 1);
  if (num_drafts_ > 0) {
    // The drafter's entry for position j also read token j + 1, so it stays valid only where
    // that token matches too; and the positions it lacks need the main model's hidden states,
    // which only a recomputation gives.
    reuse = std::min({reuse, common > 0 ? common - 1 : 0, static_cast<size_t>(drafter_->CoveredPositions())});
  }
  return reuse;
}

absl::StatusOr<SequenceStats> SequenceRunner::Run(const SequenceRequest& request,
                                                  const std::function<bool(const SequenceStep&)>& emit,
                                                  const std::function<bool()>& cancelled) {
  const int64_t vocab = model_->config().vocab_size;
  if (request.prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  for (int32_t id : request.prompt) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", id, " is outside the vocabulary of ", vocab));
    }
  }
  SamplingConfig sampling = request.sampling;
  sampling.position_keyed_draws = num_drafts_ > 0;
  ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(sampling));
  if (num_drafts_ > 0) RETURN_IF_ERROR(drafter_->BeginSequence(request.sampling));

  const size_t reuse = ReusablePrefix(request.prompt);
  ++sequences_;
  RETURN_IF_ERROR(Mirror(StepCommand::Op::kTruncateCache, static_cast<int64_t>(reuse), 0));
  RETURN_IF_ERROR(model_->TruncateCache(static_cast<int64_t>(reuse)));
  cached_tokens_.resize(reuse);

  SequenceStats stats;
  stats.prompt_tokens = static_cast<uint32_t>(request.prompt.size());
  stats.cached_prompt_tokens = static_cast<uint32_t>(reuse);
  // Room in the cache: the model's KV cache bounds the context.
  ASSIGN_OR_RETURN(const int64_t room, [&]() -> absl::StatusOr<int64_t> {
    const int64_t capacity = model_->max_tokens();
    if (static_cast<int64_t>(request.prompt.size()) >= capacity) {
      return absl::InvalidArgumentError(absl::StrCat("the prompt has ", request.prompt.size(),
                                                     " tokens; the context window is ", capacity));
    }
    return capacity - static_cast<int64_t>(request.prompt.size());
  }());
  const int64_t budget = request.max_tokens > 0 ? std::min<int64_t>(request.max_tokens, room) : room;

  auto is_stop = [&](int32_t id) {
    if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), id) != request.stop_token_ids.end()) {
      return true;
    }
    return !request.ignore_eos && std::find(eos_token_ids_.begin(), eos_token_ids_.end(), id) != eos_token_ids_.end();
  };

  // The prompt, then every emitted token; the last one has no KV until the next forward.
  std::vector<int32_t> sequence = request.prompt;
  std::vector<int32_t> input(request.prompt.begin() + static_cast<std::ptrdiff_t>(reuse), request.prompt.end());
  Drafts drafts;  // verified by the next forward, after input[0]
  int64_t generated = 0;

  // One forward: the prefill, or the last token and its drafts; then the verification of the
  // drafts, the rollback of rejected positions, and the next drafts.
  auto run_step = [&](SequenceStep& step) -> absl::Status {
    const bool prefill = generated == 0;
    const int64_t first = model_->cache_length();
    // Tensor-parallel followers replay the same forward (token order: RunsLayerMajor is off
    // while a step mirror is attached, since a layer-major pass orders its collectives per layer).
    RETURN_IF_ERROR(Mirror(prefill ? StepCommand::Op::kForwardLast : StepCommand::Op::kForward, first,
                           static_cast<uint64_t>(generated), input));
    std::vector<float> logits;
    // A plain decode step whose request the backend can sample (Sampler::DeviceDraw) hands back
    // the token alone: the draw runs in the step graph, and no logits cross to the host.
    std::optional<int32_t> device_token;
    // A greedy verification the backend can draw: every row's argmax, and only those ids cross.
    std::optional<std::vector<int32_t>> device_rows;
    if (!prefill) {
      std::optional<kernels::SampleParams> draw;
      std::vector<float> logit_delta;  // with `draw`: the request's logit_bias and penalties, if any
      std::optional<std::vector<kernels::SampleParams>> row_draws;
      // A verification of deterministic drafts (greedy ones, or the drafter's greedy drafts for a
      // sampled request where the step graphs sample) takes every row's own draw from the
      // backend: the token Sampler::Verify would pick, kept when it is the draft. A greedy one
      // also where no graph runs (the same picks, cheaper than the Sampler's per row).
      const bool verification = !drafts.tokens.empty();
      if (device_sampling_ && verification && drafts.probs.empty() &&
          (request.sampling.temperature == 0 || model_->SamplesOnDevice(input.size()))) {
        row_draws = sampler.DeviceDraws(input.size());
      } else if (device_sampling_ && !verification && model_->SamplesOnDevice(input.size())) {
        // A request with logit_bias or penalties draws there too, its adjustments added to the
        // row on the backend (one token: a plain step), when --device_logit_adjust is on.
        if (sampler.DrawsOnDevice()) {
          draw = sampler.DeviceDraw();
        } else if (device_logit_adjust_ && input.size() == 1) {
          // nullopt, drawing nothing, for what it cannot take (log-probabilities): the host's path.
          draw = sampler.DeviceDrawAdjusted(static_cast<size_t>(model_->config().vocab_size), logit_delta);
        }
      }
      if (row_draws.has_value()) {
        ASSIGN_OR_RETURN(device_rows, model_->ForwardSampledRows(input, *row_draws));
      } else if (draw.has_value()) {
        ASSIGN_OR_RETURN(device_token, model_->ForwardSampled(input, *draw, logit_delta));
      } else {
        ASSIGN_OR_RETURN(logits, model_->Forward(input));
      }
      if (const absl::Status& off = model_->step_graph_stats().disabled; !off.ok() && !graphs_off_logged_) {
        graphs_off_logged_ = true;
        spdlog::warn("decode steps run op by op from now on (a CUDA graph capture failed): {}", off.ToString());
      }
    } else if (RunsLayerMajor(input.size())) {
      model::Model::LayerMajorOptions options{.chunk_tokens = prefill_.chunk_tokens,
                                              .before_moe = prefill_.before_moe,
                                              .cancelled = cancelled};
      if (prefill_.begin_layer_major) prefill_.begin_layer_major(static_cast<int64_t>(input.size()));
      absl::StatusOr<std::vector<float>> last = model_->PrefillLayerMajor(input, options);
      if (prefill_.end_layer_major) prefill_.end_layer_major();
      ASSIGN_OR_RETURN(logits, std::move(last));
    } else {
      ASSIGN_OR_RETURN(logits, model_->ForwardLast(input));
    }
    const int n = static_cast<int>(drafts.tokens.size());
    step.drafts = n;
    for (int i = 0; i <= n; ++i) {
      bool accepted = false;
      SampledToken token;
      if (device_token.has_value()) {
        token = sampler.CommitSampled(*device_token);
      } else if (device_rows.has_value()) {
        // Sampler::Verify's greedy verdict: the row's pick, accepted when it is the draft.
        const int32_t id = (*device_rows)[static_cast<size_t>(i)];
        accepted = i < n && drafts.tokens[static_cast<size_t>(i)] == id;
        token = sampler.CommitSampled(id);
      } else if (const std::span<const float> row =
                     std::span<const float>(logits).subspan(static_cast<size_t>(prefill ? 0 : i) * vocab, vocab);
                 i < n) {
        const std::span<const float> q = drafts.probs.empty() ? std::span<const float>() : drafts.probs[i];
        ASSIGN_OR_RETURN(Sampler::Verdict verdict, sampler.Verify(row, drafts.tokens[i], q));
        accepted = verdict.accepted;
        token = std::move(verdict.token);
      } else {
        ASSIGN_OR_RETURN(token, sampler.Sample(row));
      }
      if (accepted) ++step.accepted;
      sequence.push_back(token.id);
      step.tokens.push_back(std::move(token));
      ++generated;
      if (is_stop(sequence.back())) {
        step.finish = nq::v1::FINISH_REASON_STOP;
      } else if (generated >= budget) {
        step.finish = nq::v1::FINISH_REASON_LENGTH;
      }
      if (step.finish != nq::v1::FINISH_REASON_UNSPECIFIED || !accepted) break;
    }
    // Keep what plain decoding's cache would hold: every emitted token but the last. Input
    // position i (the last token, then the drafts) is followed by emitted token i, so that is
    // one position per emitted token; the rest (rejected drafts, and an accepted draft the
    // sequence ended on) are rolled back.
    const int64_t kept = prefill ? static_cast<int64_t>(input.size()) : static_cast<int64_t>(step.tokens.size());
    RETURN_IF_ERROR(Mirror(StepCommand::Op::kTruncateCache, first + kept, static_cast<uint64_t>(generated)));
    RETURN_IF_ERROR(model_->TruncateCache(first + kept));
    cached_tokens_.insert(cached_tokens_.end(), input.begin(), input.begin() + kept);
    if (kept_observer_) kept_observer_(kept);
    drafts = Drafts();
    if (step.finish == nq::v1::FINISH_REASON_UNSPECIFIED && num_drafts_ > 0) {
      // No draft past the budget: the step after next could not emit it.
      const int want = static_cast<int>(std::min<int64_t>(num_drafts_, budget - generated - 1));
      const std::vector<float>& hidden = model_->last_hidden();
      const size_t D = static_cast<size_t>(model_->config().hidden_size);
      // A long (layer-major) prefill feeds the drafter chunk by chunk, so the MTP layer's
      // activations stay bounded too; only the last chunk drafts.
      const int64_t fed = prefill ? (kept - 1) / prefill_.chunk_tokens * prefill_.chunk_tokens : 0;
      const auto drafting = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(FeedDrafter(sequence, first, fed, hidden));
      ASSIGN_OR_RETURN(drafts, drafter_->Propose(DraftRequest{
                                   .sequence = sequence,
                                   .first_position = first + fed,
                                   .kept = kept - fed,
                                   .hidden = std::span<const float>(hidden).subspan(static_cast<size_t>(fed) * D,
                                                                                    static_cast<size_t>(kept - fed) * D),
                                   .hidden_row = fed,
                                   .num_drafts = want,
                               }));
      step.draft_seconds = SecondsSince(drafting);
    }
    input.assign(1, sequence.back());
    input.insert(input.end(), drafts.tokens.begin(), drafts.tokens.end());
    return absl::OkStatus();
  };

  auto aborted = [&] {
    SequenceStep step;
    step.finish = nq::v1::FINISH_REASON_ABORT;
    emit(step);
    return stats;
  };
  // A failed step may leave part of itself in the cache: forget the sequence rather than reuse
  // it. A cancelled one left the cache as cached_tokens_ says (whole chunks, or nothing of a
  // layer-major prefill), which the next prompt may reuse.
  auto fail = [&](const absl::Status& status) -> absl::StatusOr<SequenceStats> {
    if (status.code() == absl::StatusCode::kCancelled && cancelled() &&
        model_->cache_length() == static_cast<int64_t>(cached_tokens_.size())) {
      return aborted();
    }
    // The other ranks forget it too, if they can still be told (a broken group resets them on
    // re-forming).
    (void)Mirror(StepCommand::Op::kResetCache, 0, static_cast<uint64_t>(generated));
    model_->ResetCache();
    cached_tokens_.clear();
    return status;
  };

  // The prefill's leading chunks (steps of their own); its last chunk is the first step below.
  const auto prefill_start = std::chrono::steady_clock::now();
  absl::StatusOr<bool> prefilled = PrefillLeadingChunks(input, request.prompt, cancelled);
  if (!prefilled.ok()) return fail(prefilled.status());
  if (!*prefilled) return aborted();

  for (;;) {
    if (cancelled()) return aborted();
    const auto start = generated == 0 ? prefill_start : std::chrono::steady_clock::now();
    SequenceStep step;
    if (slots_ != nullptr) slots_->BeginStep(static_cast<uint32_t>(generated));
    const absl::Status status = run_step(step);
    if (slots_ != nullptr) slots_->EndStep();
    if (!status.ok()) return fail(status);
    step.seconds = SecondsSince(start);
    stats.completion_tokens += static_cast<uint32_t>(step.tokens.size());
    if (!emit(step)) return stats;
    if (step.finish != nq::v1::FINISH_REASON_UNSPECIFIED) return stats;
  }
}

}  // namespace nq::worker
