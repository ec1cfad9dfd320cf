#include "services/eval/gate_lookahead.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::eval {

void AddRecall(const model::MoeRouting& actual, int64_t t, const model::MoeRouting& guess, int64_t guess_token,
               LookaheadRecall& into) {
  const auto guessed = std::span<const int32_t>(guess.experts).subspan(static_cast<size_t>(guess_token * guess.top_k),
                                                                       static_cast<size_t>(guess.top_k));
  for (int j = 0; j < actual.top_k; ++j) {
    const size_t i = static_cast<size_t>(t * actual.top_k + j);
    const bool found = std::find(guessed.begin(), guessed.end(), actual.experts[i]) != guessed.end();
    into.calls += 1;
    into.found += found ? 1.0 : 0.0;
    into.weight += actual.weights[i];
    into.found_weight += found ? actual.weights[i] : 0.0;
  }
}

absl::StatusOr<LookaheadReport> MeasureGateLookahead(model::Model& model,
                                                     std::span<const std::vector<int32_t>> sequences, int depth) {
  if (depth < 1) return absl::InvalidArgumentError(absl::StrCat("lookahead depth ", depth, ": want >= 1"));
  if (sequences.empty()) return absl::InvalidArgumentError("gate lookahead: no token sequences");
  LookaheadReport report;
  report.depth = depth;
  std::map<int64_t, model::MoeRouting> actual, predicted;  // per MoE layer, this forward's
  model.SetRoutingObserver([&](int64_t layer, const model::MoeRouting& r) { actual[layer] = r; });
  model.SetLookaheadObserver(depth, [&](int64_t layer, const model::MoeRouting& r) { predicted[layer] = r; });
  std::map<int64_t, LookaheadRecall> per_layer;
  absl::Status status;
  for (const std::vector<int32_t>& sequence : sequences) {
    if (sequence.empty()) continue;
    actual.clear();
    predicted.clear();
    model.ResetCache();
    status = model.Forward(sequence).status();
    if (!status.ok()) break;
    for (const auto& [layer, guess] : predicted) {
      const auto it = actual.find(layer);
      if (it == actual.end() || it->second.num_tokens != guess.num_tokens) {
        status = absl::InternalError(absl::StrCat("layer ", layer, ": the lookahead and the routing disagree on tokens"));
        break;
      }
      for (int64_t t = 1; t < guess.num_tokens; ++t) {  // tokens with a previous token: both guesses
        AddRecall(it->second, t, guess, t, report.lookahead);
        AddRecall(it->second, t, guess, t, per_layer[layer]);
        AddRecall(it->second, t, it->second, t - 1, report.previous_token);
      }
    }
    if (!status.ok()) break;
  }
  model.SetRoutingObserver(nullptr);
  model.SetLookaheadObserver(0, nullptr);
  RETURN_IF_ERROR(status);
  for (const auto& [layer, recall] : per_layer) {
    report.layers.push_back(layer);
    report.per_layer.push_back(recall);
  }
  return report;
}

}  // namespace nq::eval
