// nq kld --mode live (issue #7): the student served through the running streamer and
// predictor v0, the 4-bit set of each block being whatever the slots hold when it runs.
// Apart from the local modes (kld_student.h) because it talks to live services.
#pragma once

#include "absl/status/statusor.h"
#include "services/tools/kld_run.h"

namespace nq::tools {

// `request` has passed ValidateKldRequest and has mode live.
absl::StatusOr<KldRunReport> RunLiveMode(const KldRequest& request);

}  // namespace nq::tools
