#include "services/worker/sequence_runner.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int64_t SequenceRunner::context_window() const { return model_->max_tokens(); }

void SequenceRunner::ForgetCache() {
  model_->ResetCache();
  cached_tokens_.clear();
}

absl::Status SequenceRunner::Mirror(StepCommand::Op op, int64_t position, uint64_t step,
                                    std::span<const int32_t> tokens) {
  if (mirror_ == nullptr) return absl::OkStatus();
  StepCommand command{.op = op, .position = position, .sequence = sequences_, .step = step};
  command.tokens.assign(tokens.begin(), tokens.end());
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
    RETURN_IF_ERROR(Mirror(prefill ? StepCommand::Op::kForwardLast : StepCommand::Op::kForward, first,
                           static_cast<uint64_t>(generated), input));
    ASSIGN_OR_RETURN(std::vector<float> logits, prefill ? model_->ForwardLast(input) : model_->Forward(input));
    const int n = static_cast<int>(drafts.tokens.size());
    step.drafts = n;
    for (int i = 0; i <= n; ++i) {
      const std::span<const float> row =
          std::span<const float>(logits).subspan(static_cast<size_t>(prefill ? 0 : i) * vocab, vocab);
      bool accepted = false;
      SampledToken token;
      if (i < n) {
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
      ASSIGN_OR_RETURN(drafts, drafter_->Propose(DraftRequest{
                                   .sequence = sequence,
                                   .first_position = first,
                                   .kept = kept,
                                   .hidden = std::span<const float>(hidden).first(static_cast<size_t>(kept) * D),
                                   .num_drafts = want,
                               }));
    }
    input.assign(1, sequence.back());
    input.insert(input.end(), drafts.tokens.begin(), drafts.tokens.end());
    return absl::OkStatus();
  };

  for (;;) {
    if (cancelled()) {
      SequenceStep step;
      step.finish = nq::v1::FINISH_REASON_ABORT;
      emit(step);
      return stats;
    }
    const auto start = std::chrono::steady_clock::now();
    SequenceStep step;
    if (slots_ != nullptr) slots_->BeginStep(static_cast<uint32_t>(generated));
    const absl::Status status = run_step(step);
    if (slots_ != nullptr) slots_->EndStep();
    if (!status.ok()) {
      // The cache may hold part of this step: forget the sequence rather than reuse it. The
      // other ranks too, if they can still be told (a broken group resets them on re-forming).
      (void)Mirror(StepCommand::Op::kResetCache, 0, static_cast<uint64_t>(generated));
      model_->ResetCache();
      cached_tokens_.clear();
      return status;
    }
    step.seconds = SecondsSince(start);
    stats.completion_tokens += static_cast<uint32_t>(step.tokens.size());
    if (!emit(step)) return stats;
    if (step.finish != nq::v1::FINISH_REASON_UNSPECIFIED) return stats;
  }
}

}  // namespace nq::worker
