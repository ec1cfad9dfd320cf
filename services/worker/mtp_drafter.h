// Drafts from the checkpoint's MTP layer (DeepSeek-V3 / GLM-5 multi-token prediction). MTP
// entry j pairs the main model's final-normed state at position j with the embedding of token
// j + 1 and predicts token j + 2; its KV sits at MTP cache position j, so the MTP cache tracks
// the main one position for position. Each Propose first rolls the MTP cache back to the
// request's first kept position (dropping the entries of the previous drafts), feeds it the
// kept positions, drafts one token from the last, then drafts further ahead autoregressively:
// each next entry reads the previous entry's shared_head-normed state and the token it drafted.
// Greedy drafts may instead be drawn and chained on the backend (SetDraftOnDevice), the same
// entries and the same argmax without a host round trip per draft; where the step graphs sample,
// a sampled request's drafts are such greedy drafts too (Propose says why).
#pragma once

#include <memory>
#include <optional>
#include <random>

#include "services/model/model.h"
#include "services/worker/drafter.h"

namespace nq::worker {

class MtpDrafter final : public Drafter {
 public:
  // `model` must have an MTP layer (Model::has_mtp) and outlive the drafter.
  explicit MtpDrafter(model::Model* model) : model_(model) {}

  absl::Status BeginSequence(const SamplingConfig& sampling) override;
  int64_t CoveredPositions() const override { return model_->mtp_cache_length(); }
  absl::StatusOr<Drafts> Propose(const DraftRequest& request) override;
  // Each MTP cache truncation and forward goes to the other ranks first (the MTP layer is
  // sharded: its forwards are collectives).
  void SetStepMirror(StepMirror* mirror) override { mirror_ = mirror; }
  // Greedy drafts drawn on the backend, chained there (Model::DraftOnDevice), where the model
  // can and the draft sampler can draw there (Sampler::DrawsOnDevice: no logit_bias): for greedy
  // requests, and for sampled ones where the step graphs sample (Model::SamplesOnDevice); under
  // tensor parallelism the whole chain goes to the other ranks as one command (kDraftOnDevice).
  // Off by default: every draft's logits come to the host.
  void SetDraftOnDevice(bool on) { draft_on_device_ = on; }

 private:
  // The draft for sequence position `position` after one row of MTP logits, appended to
  // `drafts`. Draws are keyed by position (PositionSeed), like the verifying sampler's.
  absl::Status DraftFrom(std::span<const float> logits, uint64_t position, Drafts& drafts);

  // Sends a model operation to the other ranks (no-op without a group).
  absl::Status Mirror(StepCommand::Op op, int64_t position, std::span<const int32_t> tokens = {},
                      int64_t hidden_row = 0, int32_t num_drafts = 0);

  model::Model* const model_;
  StepMirror* mirror_ = nullptr;
  bool greedy_ = true;
  bool greedy_drafts_ = true;  // greedy_, or a sampled request drafting greedily (BeginSequence)
  bool draft_on_device_ = false;
  // The draft distribution: the request's temperature, top-k, top-p and logit_bias, no
  // penalties (the drafter does not see which drafts are kept). Any distribution keeps the
  // output exact; the closer to the target's, the more drafts are accepted.
  std::optional<Sampler> draft_sampler_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace nq::worker
