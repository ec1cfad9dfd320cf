// A rank of a tensor-parallel group served by another node's streamer, as the deciding streamer
// holds it (docs/tp_streamers.md): no arena here, only what its loader needs to order its loads.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

// The rank a peer's hello describes, its loads ordered through `order_load`. INVALID_ARGUMENT for
// a rank outside its world size, a world size of 1, no group or a bad geometry;
// FAILED_PRECONDITION for rank 0 (the decider serves rank 0 itself), or a release other than
// `release_id` (this streamer's; empty: this streamer has none, so it cannot decide).
absl::StatusOr<std::shared_ptr<RegisteredWorker>> RemoteRank(const nq::v1::PeerRankHello& hello,
                                                             const std::string& release_id,
                                                             std::function<bool(const nq::v1::LoadOrder&)> order_load);

}  // namespace nq::streamer
