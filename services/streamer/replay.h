// Offline judgement of slot allocation (DESIGN.md section 7): replays a routing trace in
// blocks of refresh_interval (16) tokens and measures, for three policies, the share of
// routed expert calls, and of routing weight, that would run at 4 bits.
//
//  - oracle: each block's own top-F per layer (by calls for the call share, by routing
//    weight for the weight share) -- an upper bound for any F-slot policy;
//  - previous_block: the previous block's top-F by calls (ties: by weight, then lower id);
//  - predictor: Predictor (v0, or jF when options.learned is set) observes every token; at
//    each block boundary it refreshes and its plan (cut to the read budget) applies to the
//    next block.
// Blocks restart at each of the trace's sequence starts, where the predictor gets
// NewSequence, as the streamer does at a new RoutingReport.sequence_id.
// Loads land `landing_tokens` tokens into the block they were planned for (0: before it starts):
// an expert that arrives at a block's start serves only that block's later tokens, under the
// previous-block and predictor policies alike, and the expert it replaces serves until then (the
// replacement lands in the staging slot first); the oracle stays instant, an upper bound. Before
// the first block every policy's floating slots hold the static ranking's top F (the lowest
// ids where there is no ranking), as the streamer fills them at start-up; fixed-set experts
// are at 4 bits under every policy. A partial last block is scored like a full one.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "services/streamer/predictor.h"
#include "services/streamer/routing_trace.h"

namespace nq::streamer {

struct PolicyShare {
  double calls = 0;   // share of routed (token, layer, expert) calls at 4 bits
  double weight = 0;  // share of routing weight at 4 bits
};

struct ReplayResult {
  PolicyShare oracle;
  PolicyShare previous_block;
  PolicyShare predictor;
  uint64_t tokens = 0;
  uint64_t blocks = 0;
  uint64_t calls = 0;
  double weight = 0;
  uint64_t predictor_loads = 0;   // loads the predictor issued, all blocks
  uint64_t predictor_wanted = 0;  // loads it wanted before the budget cut
};

// `options` sets F (floating_slots), the fixed sets, the static ranking, the block length
// (refresh_interval) and the predictor's tuning; num_layers and experts_per_layer must match
// the trace (or be 0, then they are taken from it). INVALID_ARGUMENT on a mismatch or a bad
// trace.
// landing_tokens simulates the reads' delay (the predictor plans as if loads were instant).
absl::StatusOr<ReplayResult> Replay(const RoutingTrace& trace, PredictorOptions options, uint32_t landing_tokens = 0);

}  // namespace nq::streamer
