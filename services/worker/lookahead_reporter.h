// Gate lookahead within a token (issue #21), the worker's side. During a decode forward the
// model applies layer L+D's router to layer L's output (Model::SetLookaheadObserver); this turns
// each such prediction into a LookaheadHint for the streamer at once (through a sink that never
// blocks), and afterwards, from the forward's real routing, counts whether each hinted load
// landed in time:
//
//   for each expert a hint named that was not at 4 bits when the hint was sent:
//     the target layer routed to it, and it ran at 4 bits there      -> landed
//     the target layer routed to it, and it still ran at 2 bits       -> missed
//     the target layer did not route to it (a wrong prediction)       -> unrouted
//
// "Ran at 4 bits there" is read with `four_bit(layer, expert)` right after the target layer ran
// (LayerRan, before the model applies the slot mailbox again at the next MoE layer). With a slot
// mailbox the model applies what the streamer posted before every MoE layer while lookahead is on
// (Model::SetLookaheadObserver), so a load posted while the token runs can serve its target layer;
// with changes applied between steps it cannot, and every routed hinted expert counts as missed.
//
// Only forwards of at most `max_rows` tokens are decode steps (1 + MTP drafts); prefill chunks
// send nothing. The decode thread calls everything here; not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>

#include "nq/v1/streamer.pb.h"
#include "services/common/metrics/registry.h"
#include "services/model/moe_routing.h"

namespace nq::worker {

class LookaheadReporter {
 public:
  // Queues a hint for the streamer without blocking; false when it was dropped.
  using Sink = std::function<bool(nq::v1::LookaheadHint)>;
  // Whether (layer, expert)'s residual would serve a layer running now.
  using FourBit = std::function<bool(int64_t layer, int32_t expert)>;

  LookaheadReporter(int depth, int max_rows, FourBit four_bit, Sink sink, metrics::Registry& registry);

  int depth() const { return depth_; }
  // A forward of sequence `sequence_id` begins, computing its tokens from `token` on
  // (RoutingReport numbering). Drops what an unfinished earlier forward left.
  void BeginForward(uint64_t sequence_id, uint64_t token);
  // Model::SetLookaheadObserver's callback: `predicted` is layer `target_layer`'s routing of
  // this forward's tokens, predicted from layer target_layer - depth's output, which just ran.
  void OnPredicted(int64_t target_layer, const model::MoeRouting& predicted);
  // Layer `layer` of the running forward just ran (Model::SetLookaheadObserver's layer_ran): the
  // hinted experts of a target layer at or below it are judged by the table as it is now.
  void LayerRan(int64_t layer) { CheckRan(layer); }
  // The forward's real routing of one MoE layer (after the forward, in layer order).
  void OnRouting(int64_t layer, const model::MoeRouting& routing);
  // The forward ended (every OnRouting delivered): its hints are settled.
  void EndForward();

  struct Stats {
    uint64_t hints_sent = 0;
    uint64_t hints_dropped = 0;
    uint64_t landed = 0;
    uint64_t missed = 0;
    uint64_t unrouted = 0;
  };
  const Stats& stats() const { return stats_; }

 private:
  // What a hint named for one target layer of the running forward.
  struct Pending {
    std::set<int32_t> cold;  // experts not at 4 bits when hinted
    // After the target layer ran: which of `cold` were at 4 bits then (set once).
    bool checked = false;
    std::set<int32_t> warm_at_run;
  };
  // Reads four_bit for every pending target layer at or below `ran` not yet checked.
  void CheckRan(int64_t ran);

  const int depth_;
  const int max_rows_;
  const FourBit four_bit_;
  const Sink sink_;
  bool active_ = false;  // a decode forward is running
  uint64_t sequence_id_ = 0;
  uint64_t token_ = 0;
  std::map<int64_t, Pending> pending_;  // by target layer
  Stats stats_;
  metrics::Counter& landed_;
  metrics::Counter& missed_;
  metrics::Counter& unrouted_;
};

}  // namespace nq::worker
