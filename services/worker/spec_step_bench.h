// What a speculative decoding step costs beside a plain one (issue #15), measured on a model
// whose cache holds a sequence (nq bench-decode --spec_drafts N runs it after its decode steps,
// at their context): a plain 1-token forward, the 1 + N verification forward, the N drafts
// chained on the backend (Model::DraftOnDevice) after one kept row and after 1 + N (a step whose
// drafts were all accepted), and the same drafts through the host (each
// draft's logits to the host and its argmax there, as MtpDrafter without SetDraftOnDevice).
// Every forward is rolled back after it, so each round runs at the same context.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "services/model/model.h"

namespace nq::worker {

struct SpecStepTimes {
  int drafts = 0;
  int rounds = 0;
  int64_t context = 0;  // the main cache's length the forwards ran at
  // Medians over the rounds, milliseconds.
  double plain_ms = 0;
  double verify_ms = 0;
  double chained_drafts_ms = 0;
  // Chained from the 1 + N rows of a verification every draft of which was accepted: a worker's
  // MTP layer first reads every kept row (1 + accepted), chained_drafts_ms is the one-row case.
  double chained_from_verified_ms = 0;
  double observed_drafts_ms = 0;  // chained, with a routing observer set (as in a worker)
  double host_drafts_ms = 0;
};

// `drafts` in 1..4 (a step graph's tokens), `rounds` >= 1. The model must have an MTP layer and
// hold at least one token; its MTP cache is first filled to the main cache's length (states of
// zeros: the timing needs the keys, not their meaning). Afterwards both caches are as before.
absl::StatusOr<SpecStepTimes> MeasureSpecStep(model::Model& model, int drafts, int rounds);

// "spec step, 3 drafts at context 4128 (20 rounds): plain 1.20 ms, 1 + 3 verification 1.40 ms
// (1.17x), drafts chained 0.50 ms, through the host 0.90 ms; verification + chained drafts 1.58x
// a plain step".
std::string SpecStepSummary(const SpecStepTimes& times);
nlohmann::ordered_json SpecStepJson(const SpecStepTimes& times);

}  // namespace nq::worker
