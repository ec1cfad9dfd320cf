#include "services/common/flag_checks.h"

#include <cmath>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace nq {

absl::Status CheckPortFlag(std::string_view flag, int port, bool allow_ephemeral) {
  const int lowest = allow_ephemeral ? 0 : 1;
  if (port < lowest || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", std::string(flag), "=", port, ": a port must be in ", lowest, "..65535"));
  }
  return absl::OkStatus();
}

absl::Status CheckAddressFlag(std::string_view flag, std::string_view address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(std::string(address.substr(colon + 1)), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", std::string(flag), "=", std::string(address), ": want host:port with a port in 1..65535"));
  }
  return absl::OkStatus();
}

absl::Status CheckPositiveSecondsFlag(std::string_view flag, double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", std::string(flag), "=", seconds, ": want a positive number of seconds"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> GlobalRank(int node_rank, int ranks_per_node, int local_rank) {
  if (node_rank < 0) return absl::InvalidArgumentError(absl::StrCat("--node_rank=", node_rank, ": want >= 0"));
  if (ranks_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node_rank needs --ranks_per_node >= 1 (the ranks each node holds), not ", ranks_per_node));
  }
  if (local_rank < 0 || local_rank >= ranks_per_node) {
    return absl::InvalidArgumentError(absl::StrCat("--rank=", local_rank, " with --node_rank: want the rank within the "
                                                   "node, 0..", ranks_per_node - 1));
  }
  return node_rank * ranks_per_node + local_rank;
}

}  // namespace nq
