// Validation of flag values shared by the service binaries: a bad value is a clear message
// and a non-zero exit before anything starts.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace nq {

// A listening port: 1..65535 (0 only when allow_ephemeral, for tests).
absl::Status CheckPortFlag(std::string_view flag, int port, bool allow_ephemeral = false);
// "host:port" of a peer service.
absl::Status CheckAddressFlag(std::string_view flag, std::string_view address);
// A strictly positive duration in seconds.
absl::Status CheckPositiveSecondsFlag(std::string_view flag, double seconds);

}  // namespace nq
