#include "services/tools/kld_live.h"

namespace nq::tools {

absl::StatusOr<KldRunReport> RunLiveMode(const KldRequest& request) {
  return absl::UnimplementedError(
      "nq kld --mode live is not implemented yet (issue #7: it runs the student through the running streamer and "
      "predictor v0); the local modes are all-4-bit, all-2-bit, fixed-set, oracle and previous-block");
}

}  // namespace nq::tools
