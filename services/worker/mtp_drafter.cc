#include "services/worker/mtp_drafter.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

// Draft draws use their own stream, apart from the target sampler's, so a seeded request is
// reproducible for a given --speculative_tokens.
constexpr uint64_t kDraftSeedSalt = 0x9e3779b97f4a7c15ull;

}  // namespace

absl::Status MtpDrafter::BeginSequence(const SamplingConfig& sampling) {
  SamplingConfig draft = sampling;
  draft.presence_penalty = 0;
  draft.frequency_penalty = 0;
  draft.top_logprobs = 0;
  draft.logprobs = false;  // drafts report none: greedy drafting is an argmax
  ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(draft));
  draft_sampler_.emplace(std::move(sampler));
  greedy_ = sampling.temperature == 0;
  // A sampled request's drafts are greedy ones where the step graphs sample (Propose says why).
  greedy_drafts_ = greedy_ || (draft_on_device_ && draft_sampler_->DrawsOnDevice() && model_->SamplesOnDevice(1));
  seed_ = sampling.seed ^ kDraftSeedSalt;
  return absl::OkStatus();
}

absl::Status MtpDrafter::DraftFrom(std::span<const float> logits, uint64_t position, Drafts& drafts) {
  if (!draft_sampler_.has_value()) return absl::FailedPreconditionError("MtpDrafter: no BeginSequence");
  if (greedy_drafts_ && !greedy_) {
    // A sampled request's greedy draft: the most likely token of its distribution, the largest
    // finite logit (the lower id on ties; no logit_bias, or it would not draft greedily), found
    // without that distribution's pass over the vocabulary.
    int64_t best = -1;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (std::isfinite(logits[i]) && (best < 0 || logits[i] > logits[static_cast<size_t>(best)])) {
        best = static_cast<int64_t>(i);
      }
    }
    if (best < 0) return absl::InvalidArgumentError("MtpDrafter: the draft's logits have no finite value");
    drafts.tokens.push_back(static_cast<int32_t>(best));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<float> q, draft_sampler_->Distribution(logits));
  if (greedy_) {
    // Distribution puts all mass on the greedy pick (the argmax, lower id on ties).
    drafts.tokens.push_back(static_cast<int32_t>(std::max_element(q.begin(), q.end()) - q.begin()));
    return absl::OkStatus();
  }
  rng_.seed(PositionSeed(seed_, position));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double u = uniform(rng_);
  double acc = 0;
  int32_t id = -1;
  for (size_t i = 0; i < q.size(); ++i) {
    if (q[i] <= 0) continue;
    id = static_cast<int32_t>(i);  // rounding past the end lands on the last token with mass
    acc += q[i];
    if (u < acc) break;
  }
  drafts.tokens.push_back(id);
  drafts.probs.push_back(std::move(q));
  return absl::OkStatus();
}

absl::Status MtpDrafter::Mirror(StepCommand::Op op, int64_t position, std::span<const int32_t> tokens,
                                int64_t hidden_row, int32_t num_drafts) {
  if (mirror_ == nullptr) return absl::OkStatus();
  StepCommand command{.op = op, .position = position, .hidden_row = hidden_row, .num_drafts = num_drafts};
  command.tokens.assign(tokens.begin(), tokens.end());
  return mirror_->Mirror(command);
}

absl::StatusOr<Drafts> MtpDrafter::Propose(const DraftRequest& r) {
  const int64_t D = model_->config().hidden_size;
  // Every kept position needs the token after it.
  if (r.first_position < 0 || r.kept <= 0 || static_cast<int64_t>(r.hidden.size()) != r.kept * D ||
      r.first_position + r.kept >= static_cast<int64_t>(r.sequence.size())) {
    return absl::InternalError(absl::StrCat("MtpDrafter: ", r.kept, " kept positions from ", r.first_position,
                                            " with ", r.hidden.size(), " hidden values for a sequence of ",
                                            r.sequence.size()));
  }
  // Entries past first_position hold the previous drafts (or a rejected run): roll them back.
  if (model_->mtp_cache_length() < r.first_position) {
    return absl::InternalError(absl::StrCat("MtpDrafter: the MTP cache covers ", model_->mtp_cache_length(),
                                            " positions, the kept run starts at ", r.first_position));
  }
  RETURN_IF_ERROR(Mirror(StepCommand::Op::kTruncateMtpCache, r.first_position));
  RETURN_IF_ERROR(model_->TruncateMtpCache(r.first_position));
  const std::span<const int32_t> next_tokens = r.sequence.subspan(static_cast<size_t>(r.first_position + 1),
                                                                  static_cast<size_t>(r.kept));
  Drafts drafts;
  // A sampled request drafts greedily too where the step graphs sample (SamplesOnDevice, checked
  // at BeginSequence): its drafts are then deterministic, and verification keeps each row's own
  // draw when it is the draft (Sampler::Verify), on the backend. Drawing drafts from the draft
  // distribution instead brings every draft's logits and every verified row's to the host, where
  // one row at 129k-155k ids costs 3-7 ms of sampling (bench/README.md), more than a whole GPU
  // step; the price is acceptance: p(draft) a row instead of rejection sampling's overlap of the
  // two distributions.
  if (r.num_drafts > 0 && greedy_drafts_ && draft_on_device_ && draft_sampler_.has_value() &&
      draft_sampler_->DrawsOnDevice() && model_->DraftsOnDevice(next_tokens.size(), r.num_drafts)) {
    // The greedy pick (Distribution's argmax at temperature 0, the lower id on ties). Under tensor
    // parallelism every rank runs the same chain (its forwards are collectives) and draws the same
    // argmax from the same gathered logits.
    RETURN_IF_ERROR(Mirror(StepCommand::Op::kDraftOnDevice, model_->mtp_cache_length(), next_tokens, r.hidden_row,
                           r.num_drafts));
    ASSIGN_OR_RETURN(drafts.tokens, model_->DraftOnDevice(next_tokens, r.hidden, r.num_drafts, kernels::SampleParams{}));
    return drafts;
  }
  RETURN_IF_ERROR(Mirror(StepCommand::Op::kForwardMtpLast, model_->mtp_cache_length(), next_tokens, r.hidden_row));
  ASSIGN_OR_RETURN(std::vector<float> logits, model_->ForwardMtpLast(next_tokens, r.hidden));
  if (r.num_drafts == 0) return drafts;
  // Draft i is the token at sequence position sequence.size() + i.
  RETURN_IF_ERROR(DraftFrom(logits, r.sequence.size(), drafts));
  while (static_cast<int>(drafts.tokens.size()) < r.num_drafts) {
    const std::vector<float> state = model_->last_mtp_hidden();
    const std::span<const float> last_state = std::span<const float>(state).last(static_cast<size_t>(D));
    const std::span<const int32_t> draft(&drafts.tokens.back(), 1);
    RETURN_IF_ERROR(Mirror(StepCommand::Op::kForwardMtpLast, model_->mtp_cache_length(), draft,
                           StepCommand::kLastMtpHidden));
    ASSIGN_OR_RETURN(logits, model_->ForwardMtpLast(draft, last_state));
    RETURN_IF_ERROR(DraftFrom(logits, r.sequence.size() + drafts.tokens.size(), drafts));
  }
  return drafts;
}

}  // namespace nq::worker
