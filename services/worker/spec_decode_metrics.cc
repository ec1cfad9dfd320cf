#include "services/worker/spec_decode_metrics.h"

#include <string>

namespace nq::worker {

SpecDecodeMetrics::SpecDecodeMetrics(metrics::Registry& registry, int max_drafts)
    : num_drafts_(registry
                      .Counter("nq_spec_decode_num_drafts_total",
                               "Speculative verification steps that verified at least one draft token")
                      .Get()),
      draft_tokens_(registry.Counter("nq_spec_decode_num_draft_tokens_total", "Draft tokens verified").Get()),
      accepted_tokens_(
          registry.Counter("nq_spec_decode_num_accepted_tokens_total", "Draft tokens accepted by verification")
              .Get()) {
  auto& per_position = registry.Counter("nq_spec_decode_num_accepted_tokens_per_pos_total",
                                        "Draft tokens accepted, by position in the draft (0: the first)",
                                        {"position"});
  for (int k = 0; k < max_drafts; ++k) accepted_per_position_.push_back(&per_position.WithLabels({std::to_string(k)}));
}

void SpecDecodeMetrics::RecordStep(int drafts, int accepted) {
  if (drafts <= 0) return;
  num_drafts_.Increment();
  draft_tokens_.Increment(drafts);
  accepted_tokens_.Increment(accepted);
  for (int k = 0; k < accepted && k < static_cast<int>(accepted_per_position_.size()); ++k) {
    accepted_per_position_[k]->Increment();
  }
}

}  // namespace nq::worker
