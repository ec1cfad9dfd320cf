// The main() of the cluster's services (nq-router, nq-streamer, nq-worker), one for all three:
// block SIGTERM / SIGINT before any thread starts, parse the flags, start logging at
// --log_level (defined here, once for every service), then run the service until it returns.
#pragma once

#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "services/common/shutdown_signal.h"

namespace nq {

// `service` names the logger and the binary ("router": nq-router). Exit status: 0 when `run`
// returns OK, 1 when it fails or the signals cannot be blocked, 2 for a bad --log_level. A
// failure before logging goes to stderr; `run`'s as a critical log line.
int ServiceMain(int argc, char** argv, std::string_view service, const char* usage,
                absl::FunctionRef<absl::Status(ShutdownSignal&)> run);

}  // namespace nq
