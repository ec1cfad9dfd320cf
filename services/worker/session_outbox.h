// The bound on what waits for the streamer session's writer (streamer_client.h): advice
// (routing reports, lookahead hints) is capped per kind, so a streamer that falls behind costs
// the decode loop nothing but the oldest advice; unmap acknowledgements are never capped.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>

#include "nq/v1/streamer.pb.h"

namespace nq::worker {

// Appends `message` to `outbox`. When `queued` (messages of its kind, as `is_kind` tells them,
// now in `outbox`) has reached `max`, the oldest of that kind is dropped first, so the newest
// advice wins. Returns how many were dropped (0 or 1); `queued` counts the kind afterwards.
// Never blocks; constant work but for the scan to the oldest of the kind.
size_t PushDroppingOldest(std::deque<nq::v1::WorkerMessage>& outbox, size_t& queued, size_t max,
                          nq::v1::WorkerMessage message,
                          const std::function<bool(const nq::v1::WorkerMessage&)>& is_kind);

}  // namespace nq::worker
