// The events a worker's session thread hands its loader thread (slot_loader.h): routing
// reports and unmap acks, in arrival order, with a bound on the reports.
//
// Unmap acks are never dropped: each frees slots the loader may reuse only once acked, and
// there is at most one per update the loader sent, so the loader's own pace bounds them.
// Lookahead hints (issue #21) are advice too, and bounded apart (`max_hints`, the incoming one
// dropped and counted past it): a worker sends one per MoE layer per decode token, and a
// backlog of them names tokens long gone.
// Routing reports are advice for the predictor and arrive at the worker's pace: when
// `max_reports` are already waiting, the incoming one is dropped and counted (the predictor
// then sees a gap in that sequence, which ReportOrder accepts and counts). Dropping the
// newest rather than the oldest keeps the queue a plain FIFO, so acks keep their order
// relative to the reports around them.
//
// Not thread-safe: SlotLoader holds its mutex around every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <variant>

#include "nq/v1/streamer.pb.h"
#include "services/common/metrics/counter.h"

namespace nq::streamer {

class LoaderEvents {
 public:
  // An unmap ack from rank `rank` of a tensor-parallel group (group_sessions.h): a group's slot
  // is free only once every rank acknowledged its unmap.
  struct RankAck {
    uint32_t rank = 0;
    nq::v1::UnmapAck ack;
  };
  // The answer of a remote rank's streamer to one of the loader's orders (peer_service.h).
  struct PeerResult {
    uint32_t rank = 0;
    nq::v1::LoadResult result;
  };
  using Event = std::variant<nq::v1::RoutingReport, nq::v1::UnmapAck, RankAck, PeerResult, nq::v1::LookaheadHint>;
  // Hints waiting at most (kDefaultMaxHints: a few tokens of a large model's layers).
  static constexpr size_t kDefaultMaxHints = 256;

  // `max_reports` of 0 is taken as 1 (a loader that takes no report could never predict);
  // `dropped` (may be null) counts the reports dropped.
  LoaderEvents(size_t max_reports, metrics::Counter* dropped, size_t max_hints = kDefaultMaxHints,
               metrics::Counter* dropped_hints = nullptr);

  // False when the report was dropped (max_reports already wait).
  bool PushReport(nq::v1::RoutingReport report);
  void PushAck(nq::v1::UnmapAck ack);
  void PushRankAck(uint32_t rank, nq::v1::UnmapAck ack);
  // False when the hint was dropped (max_hints already wait).
  bool PushHint(nq::v1::LookaheadHint hint);
  // Like acks, never dropped: each ends a load that holds a slot.
  void PushPeerResult(uint32_t rank, nq::v1::LoadResult result);
  // Everything queued, oldest first; the queue is empty afterwards.
  std::deque<Event> TakeAll();

  size_t queued_reports() const { return queued_reports_; }
  uint64_t dropped_reports() const { return dropped_reports_; }
  size_t queued_hints() const { return queued_hints_; }
  uint64_t dropped_hints() const { return dropped_hints_count_; }

 private:
  const size_t max_reports_;
  metrics::Counter* const dropped_;
  std::deque<Event> events_;
  size_t queued_reports_ = 0;
  uint64_t dropped_reports_ = 0;
  const size_t max_hints_;
  metrics::Counter* const dropped_hints_;
  size_t queued_hints_ = 0;
  uint64_t dropped_hints_count_ = 0;
};

}  // namespace nq::streamer
