// Validation of flag values shared by the service binaries: a bad value is a clear message
// and a non-zero exit before anything starts.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq {

// A listening port: 1..65535 (0 only when allow_ephemeral, for tests).
absl::Status CheckPortFlag(std::string_view flag, int port, bool allow_ephemeral = false);
// "host:port" of a peer service.
absl::Status CheckAddressFlag(std::string_view flag, std::string_view address);
// A strictly positive duration in seconds.
absl::Status CheckPositiveSecondsFlag(std::string_view flag, double seconds);

// The tensor-parallel rank of a worker given by its node's place in a group spanning nodes
// (--node_rank, as a Kubernetes StatefulSet numbers its pods), the ranks each node holds
// (--ranks_per_node) and its rank within the node (--rank): node_rank x ranks_per_node +
// local_rank. INVALID_ARGUMENT for a negative node rank, ranks_per_node below 1, or a local rank
// outside 0..ranks_per_node-1.
absl::StatusOr<int> GlobalRank(int node_rank, int ranks_per_node, int local_rank);

}  // namespace nq
