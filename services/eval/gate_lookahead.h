// Gate lookahead, measured offline (issue #21): how well the experts an MoE layer will route to
// are known `depth` layers early, from that layer's router applied to the hidden state `depth`
// layers before it (Model::SetLookaheadObserver). Compared with the recency guess a predictor
// makes without it: the same layer's experts of the previous token. For each (token, MoE layer
// with a layer `depth` before it; every token but a sequence's first), recall is the share of the layer's actual top-k found in the
// guessed top-k, and weight recall the share of its routing weight.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "services/model/model.h"
#include "services/model/moe_routing.h"

namespace nq::eval {

struct LookaheadRecall {
  int64_t calls = 0;         // (token, layer, expert) routing calls scored
  double found = 0;          // of them, in the guessed set
  double weight = 0;         // their routing weight
  double found_weight = 0;   // of it, on experts in the guessed set

  double recall() const { return calls > 0 ? found / static_cast<double>(calls) : 0; }
  double weight_recall() const { return weight > 0 ? found_weight / weight : 0; }
};

struct LookaheadReport {
  int depth = 0;
  LookaheadRecall lookahead;        // the router of layer L + depth on layer L's output
  LookaheadRecall previous_token;   // the same layer's experts of the previous token (recency)
  std::vector<int64_t> layers;      // the MoE layers scored (those with a layer `depth` before them)
  std::vector<LookaheadRecall> per_layer;  // lookahead, per scored layer
};

// Adds to `into` how many of `actual`'s calls of token t (top_k experts and weights) are among
// the guessed experts of token `guess_token` in `guess`.
void AddRecall(const model::MoeRouting& actual, int64_t t, const model::MoeRouting& guess, int64_t guess_token,
               LookaheadRecall& into);

// Runs each sequence through `model` (a fresh cache each; its cache must hold the longest) with
// the lookahead at `depth` (>= 1). INVALID_ARGUMENT for depth < 1 or no sequence; the model's
// observers are cleared on return.
absl::StatusOr<LookaheadReport> MeasureGateLookahead(model::Model& model,
                                                     std::span<const std::vector<int32_t>> sequences, int depth);

}  // namespace nq::eval
