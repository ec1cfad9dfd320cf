#include "services/eval/mtp_acceptance.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::eval {
namespace {

int64_t Argmax(std::span<const float> row) { return std::max_element(row.begin(), row.end()) - row.begin(); }

void Add(MtpAcceptance& total, const MtpAcceptance& part) {
  total.drafts += part.drafts;
  total.accepted += part.accepted;
  total.text_drafts += part.text_drafts;
  total.text_matches += part.text_matches;
}

}  // namespace

absl::StatusOr<MtpAcceptanceReport> MeasureMtpAcceptance(model::Model& model, std::span<const KldDomain> domains,
                                                         int64_t window) {
  if (window < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--window ", window, ": a window needs at least 2 tokens"));
  }
  if (!model.has_mtp()) {
    return absl::FailedPreconditionError(
        model.mtp_missing().empty() ? "the model has no MTP layer (num_nextn_predict_layers is 0)"
                                    : absl::StrCat("the model has no MTP layer: ", model.mtp_missing()));
  }
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  const size_t hidden = static_cast<size_t>(model.config().hidden_size);
  MtpAcceptanceReport report;
  for (const KldDomain& domain : domains) {
    MtpAcceptance part;
    for (const std::vector<int32_t>& sequence : domain.sequences) {
      const std::span<const int32_t> ids(sequence);
      for (size_t start = 0; start < ids.size(); start += static_cast<size_t>(window)) {
        const std::span<const int32_t> w = ids.subspan(start, std::min<size_t>(window, ids.size() - start));
        if (w.size() < 2) continue;
        const size_t T = w.size();
        model.ResetCache();
        ASSIGN_OR_RETURN(std::vector<float> main, model.Forward(w));
        const std::vector<float> states = model.last_hidden();
        ASSIGN_OR_RETURN(std::vector<float> draft,
                         model.ForwardMtp(w.subspan(1), std::span<const float>(states).first((T - 1) * hidden)));
        // Draft i predicts token i+2; the main model's greedy choice for it is row i+1.
        for (size_t i = 0; i + 1 < T; ++i) {
          const int64_t drafted = Argmax(std::span<const float>(draft).subspan(i * vocab, vocab));
          const int64_t greedy = Argmax(std::span<const float>(main).subspan((i + 1) * vocab, vocab));
          ++part.drafts;
          part.accepted += drafted == greedy ? 1 : 0;
          if (i + 2 < T) {
            ++part.text_drafts;
            part.text_matches += drafted == w[i + 2] ? 1 : 0;
          }
        }
      }
    }
    report.domains.emplace_back(domain.name, part);
    Add(report.overall, part);
  }
  return report;
}

}  // namespace nq::eval
