// nq mtp-acceptance (issue #7): how often the model's own MTP layer would have its draft
// accepted, measured offline. The main model runs teacher-forced over each window; MTP entry
// i reads the hidden state of position i and the embedding of token i+1 and drafts token
// i+2; the draft is accepted when it equals the main model's greedy choice at position i+1
// (draft vs greedy next token, as speculative decoding with greedy sampling would accept).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/eval/kld_harness.h"
#include "services/model/model.h"

namespace nq::eval {

struct MtpAcceptance {
  int64_t drafts = 0;
  int64_t accepted = 0;      // draft == the main model's greedy token at the next position
  int64_t text_drafts = 0;   // drafts whose target token is in the window
  int64_t text_matches = 0;  // draft == the text's token

  double rate() const { return drafts > 0 ? static_cast<double>(accepted) / static_cast<double>(drafts) : 0; }
  double text_rate() const {
    return text_drafts > 0 ? static_cast<double>(text_matches) / static_cast<double>(text_drafts) : 0;
  }
};

struct MtpAcceptanceReport {
  MtpAcceptance overall;
  std::vector<std::pair<std::string, MtpAcceptance>> domains;  // in the order given
};

// Windows of `window` tokens (a fresh cache each; a window of one token drafts nothing).
// `model`'s cache must hold a window. FAILED_PRECONDITION when the checkpoint has no MTP
// layer; INVALID_ARGUMENT for window < 2.
absl::StatusOr<MtpAcceptanceReport> MeasureMtpAcceptance(model::Model& model, std::span<const KldDomain> domains,
                                                         int64_t window);

}  // namespace nq::eval
