#include "services/worker/lookahead_reporter.h"

#include <algorithm>
#include <utility>

namespace nq::worker {

LookaheadReporter::LookaheadReporter(int depth, int max_rows, FourBit four_bit, Sink sink,
                                     metrics::Registry& registry)
    : depth_(depth),
      max_rows_(max_rows),
      four_bit_(std::move(four_bit)),
      sink_(std::move(sink)),
      landed_(registry
                  .Counter("nq_worker_lookahead_experts_total",
                           "Experts a gate lookahead hint named that were at 2 bits when it was sent, by outcome at "
                           "the target layer of the same token: landed (routed there and ran at 4 bits: the hinted "
                           "load was READY in time), missed (routed there, still 2 bits), unrouted (the layer did "
                           "not route to it)",
                           {"outcome"})
                  .WithLabels({"landed"})),
      missed_(registry.Counter("nq_worker_lookahead_experts_total", "", {"outcome"}).WithLabels({"missed"})),
      unrouted_(registry.Counter("nq_worker_lookahead_experts_total", "", {"outcome"}).WithLabels({"unrouted"})) {}

void LookaheadReporter::BeginForward(uint64_t sequence_id, uint64_t token) {
  pending_.clear();
  active_ = true;
  sequence_id_ = sequence_id;
  token_ = token;
}

void LookaheadReporter::CheckRan(int64_t ran) {
  for (auto& [layer, pending] : pending_) {
    if (layer > ran) break;
    if (pending.checked) continue;
    pending.checked = true;
    for (int32_t e : pending.cold) {
      if (four_bit_(layer, e)) pending.warm_at_run.insert(e);
    }
  }
}

void LookaheadReporter::OnPredicted(int64_t target_layer, const model::MoeRouting& predicted) {
  if (!active_ || predicted.num_tokens < 1 || predicted.num_tokens > max_rows_) return;
  // Layer target - depth just ran: a target layer at or below it ran before it, with the table
  // as it is now (the next MoE layer's apply has not happened yet).
  CheckRan(target_layer - depth_);
  nq::v1::LookaheadHint hint;
  hint.set_sequence_id(sequence_id_);
  hint.set_token(token_);
  hint.set_layer(static_cast<uint32_t>(target_layer));
  hint.set_source_layer(static_cast<uint32_t>(target_layer - depth_));
  // Every row's experts (MTP verification runs several tokens), first row first, each once.
  std::set<int32_t> named;
  Pending& pending = pending_[target_layer];
  pending = Pending{};
  for (size_t i = 0; i < predicted.experts.size(); ++i) {
    const int32_t e = predicted.experts[i];
    if (e < 0 || !named.insert(e).second) continue;
    hint.add_experts(static_cast<uint32_t>(e));
    if (predicted.num_tokens == 1 && i < predicted.weights.size()) hint.add_weights(predicted.weights[i]);
    if (!four_bit_(target_layer, e)) pending.cold.insert(e);
  }
  if (hint.experts_size() == 0) return;
  if (sink_(std::move(hint))) {
    ++stats_.hints_sent;
  } else {
    ++stats_.hints_dropped;
  }
}

void LookaheadReporter::OnRouting(int64_t layer, const model::MoeRouting& routing) {
  if (!active_) return;
  auto it = pending_.find(layer);
  if (it == pending_.end()) return;
  CheckRan(layer);  // no prediction came after it: the table is still as the layer ran it
  const Pending& pending = it->second;
  for (int32_t e : pending.cold) {
    const bool routed = std::find(routing.experts.begin(), routing.experts.end(), e) != routing.experts.end();
    if (!routed) {
      ++stats_.unrouted;
      unrouted_.Increment();
    } else if (pending.warm_at_run.count(e) != 0) {
      ++stats_.landed;
      landed_.Increment();
    } else {
      ++stats_.missed;
      missed_.Increment();
    }
  }
  pending_.erase(it);
}

void LookaheadReporter::EndForward() {
  pending_.clear();
  active_ = false;
}

}  // namespace nq::worker
