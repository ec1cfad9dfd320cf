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
  ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(request.sampling));

  // Longest common prefix with what the cache holds; at least the last prompt token is
  // recomputed so there are logits to sample from.
  size_t reuse = 0;
  while (reuse < cached_tokens_.size() && reuse < request.prompt.size() &&
         cached_tokens_[reuse] == request.prompt[reuse]) {
    ++reuse;
  }
  reuse = std::min(reuse, request.prompt.size() - 1);
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

  std::span<const int32_t> input = std::span<const int32_t>(request.prompt).subspan(reuse);
  std::vector<int32_t> next(1);
  for (int64_t generated = 0;; ++generated) {
    if (cancelled()) {
      SequenceStep step;
      step.finish = nq::v1::FINISH_REASON_ABORT;
      emit(step);
      return stats;
    }
    const auto start = std::chrono::steady_clock::now();
    if (slots_ != nullptr) slots_->BeginStep(static_cast<uint32_t>(generated));
    absl::StatusOr<std::vector<float>> logits = model_->ForwardLast(input);
    if (slots_ != nullptr) slots_->EndStep();
    if (!logits.ok()) {
      // The cache may hold part of this step: forget the sequence rather than reuse it.
      model_->ResetCache();
      cached_tokens_.clear();
      return logits.status();
    }
    cached_tokens_.insert(cached_tokens_.end(), input.begin(), input.end());
    ASSIGN_OR_RETURN(SampledToken token, sampler.Sample(*logits));
    SequenceStep step;
    step.seconds = SecondsSince(start);
    step.tokens.push_back(token);
    ++stats.completion_tokens;
    if (is_stop(token.id)) {
      step.finish = nq::v1::FINISH_REASON_STOP;
    } else if (generated + 1 >= budget) {
      step.finish = nq::v1::FINISH_REASON_LENGTH;
    }
    if (!emit(step)) return stats;
    if (step.finish != nq::v1::FINISH_REASON_UNSPECIFIED) return stats;
    next[0] = token.id;
    input = next;
  }
}

}  // namespace nq::worker
