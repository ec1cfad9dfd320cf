// Where a worker's routing reports stand in its token stream (nq.v1.RoutingReport): the
// worker numbers its sequences (sequence_id grows with each new one) and reports every token
// it runs in blocks whose first_token continues where the previous block ended. The worker may
// drop a block when its queue is full or no session is up (nq_worker_routing_reports_dropped_total),
// so a gap is expected; going backwards is not: a report of an older sequence, or one that
// repeats tokens already reported, would feed the predictor the same routing twice or out of
// order, and is refused.
//
// One ReportOrder per worker session (a new session may start anywhere).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq::streamer {

enum class ReportPlace {
  kFirst,        // the session's first report
  kNext,         // continues the previous report
  kNewSequence,  // the first report of a later sequence
  kAfterGap,     // same sequence, tokens missing before it (the worker dropped a block)
};

class ReportOrder {
 public:
  // Where `report` falls; accepted reports advance the cursor. INVALID_ARGUMENT, with the
  // cursor unchanged, for num_tokens 0, a sequence_id below the last one, or a first_token
  // before the end of the last report of the same sequence.
  absl::StatusOr<ReportPlace> Accept(const nq::v1::RoutingReport& report);

 private:
  bool started_ = false;
  uint64_t sequence_id_ = 0;
  uint64_t next_token_ = 0;  // first_token + num_tokens of the last accepted report
};

}  // namespace nq::streamer
