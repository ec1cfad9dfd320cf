// Speculative decoding's counters on the worker's /metrics (DESIGN.md section 8; the names
// vLLM uses, with our nq_ prefix). Per verification step with d > 0 drafts of which the
// first a were accepted: drafts += 1, draft_tokens += d, accepted_tokens += a, and
// accepted_tokens_per_pos{position="k"} += 1 for k < a (position 0 is the first draft). So
// accepted / draft_tokens is the acceptance rate, 1 + accepted / drafts the mean tokens a
// step emits, and per_pos{k} / drafts the acceptance of draft k.
#pragma once

#include <vector>

#include "services/common/metrics/registry.h"

namespace nq::worker {

class SpecDecodeMetrics {
 public:
  // Creates the families in `registry`, with a per-position series for each of `max_drafts`
  // positions present (at 0) from the start.
  SpecDecodeMetrics(metrics::Registry& registry, int max_drafts);

  // One verification step; `drafts` may be below max_drafts near max_tokens. Steps without
  // drafts count nothing.
  void RecordStep(int drafts, int accepted);

 private:
  metrics::Counter& num_drafts_;
  metrics::Counter& draft_tokens_;
  metrics::Counter& accepted_tokens_;
  std::vector<metrics::Counter*> accepted_per_position_;
};

}  // namespace nq::worker
