#include "services/streamer/report_order.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace nq::streamer {

absl::StatusOr<ReportPlace> ReportOrder::Accept(const nq::v1::RoutingReport& report) {
  if (report.num_tokens() == 0) return absl::InvalidArgumentError("routing report with num_tokens 0");
  // A first token this close to the end of the range would wrap next_token_ around, and the same
  // report would then be accepted again as a later one.
  if (report.first_token() > std::numeric_limits<decltype(next_token_)>::max() - report.num_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("routing report starting at token ", report.first_token(),
                                                   " with ", report.num_tokens(), " tokens overflows the token count"));
  }
  ReportPlace place = ReportPlace::kFirst;
  if (started_) {
    if (report.sequence_id() < sequence_id_) {
      return absl::InvalidArgumentError(absl::StrCat("routing report of sequence ", report.sequence_id(),
                                                     " after sequence ", sequence_id_, " (stale)"));
    }
    if (report.sequence_id() > sequence_id_) {
      place = ReportPlace::kNewSequence;
    } else if (report.first_token() < next_token_) {
      return absl::InvalidArgumentError(absl::StrCat("routing report of sequence ", report.sequence_id(),
                                                     " starts at token ", report.first_token(),
                                                     ", already reported up to ", next_token_, " (repeated)"));
    } else {
      place = report.first_token() == next_token_ ? ReportPlace::kNext : ReportPlace::kAfterGap;
    }
  }
  started_ = true;
  sequence_id_ = report.sequence_id();
  next_token_ = report.first_token() + report.num_tokens();
  return place;
}

}  // namespace nq::streamer
