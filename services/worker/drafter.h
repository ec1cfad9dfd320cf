// Where speculative decoding's drafts come from (DESIGN.md section 3): after every main-model
// forward the sequence runner hands the drafter the positions that forward kept, and asks for
// the next drafts. MtpDrafter (the model's own MTP layer) serves; tests plug in drafters whose
// drafts they choose, to reject at a chosen position.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "services/worker/sampler.h"
#include "services/worker/step_command.h"

namespace nq::worker {

struct DraftRequest {
  // Prompt + every emitted token; the last one has no KV yet (the next forward runs it).
  std::span<const int32_t> sequence;
  // The last forward kept main-model positions [first_position, first_position + kept);
  // `hidden` holds their final-normed states, [kept, hidden_size]. The token after position
  // j is sequence[j + 1].
  int64_t first_position = 0;
  int64_t kept = 0;
  std::span<const float> hidden;
  // The row of Model::last_hidden() where `hidden` starts: tensor-parallel followers take their
  // own copy of the same rows (step_command.h, kForwardMtpLast).
  int64_t hidden_row = 0;
  int num_drafts = 0;  // >= 0; 0 only keeps the drafter's state in step
};

struct Drafts {
  std::vector<int32_t> tokens;  // to verify after sequence.back(), in order
  // probs[i]: the distribution tokens[i] was drawn from ([vocab]); empty when drafts are
  // deterministic (greedy), which verification reads as all mass on the draft.
  std::vector<std::vector<float>> probs;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // A new sequence with these sampling settings (its drafts are drawn the same way).
  virtual absl::Status BeginSequence(const SamplingConfig& sampling) = 0;
  // Main-model positions the drafter's own state covers; a new prompt may keep the main KV
  // cache only up to here (the runner recomputes the rest, feeding the drafter again).
  virtual int64_t CoveredPositions() const = 0;
  virtual absl::StatusOr<Drafts> Propose(const DraftRequest& request) = 0;
  // Where a tensor-parallel leader sends the model operations drafting runs, so the other ranks
  // run them too; a drafter that runs no model operations ignores it.
  virtual void SetStepMirror(StepMirror* mirror) {}
};

}  // namespace nq::worker
