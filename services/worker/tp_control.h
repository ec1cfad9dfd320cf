// The control channel of this rank's tensor-parallel group (kernels/comm/group_control.h): one
// host's shared memory, or TCP to rank 0 when TpGroupOptions::tcp_address is set.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/comm/group_control.h"
#include "services/worker/tp_group_options.h"

namespace nq::worker {

// Rank 0: a new group of `generation` (ShmCommunicator::Create or TcpCommunicator::Create).
absl::StatusOr<std::unique_ptr<kernels::GroupControl>> CreateGroupControl(const TpGroupOptions& options,
                                                                          uint64_t generation);
// Rank > 0: joins rank 0's group (Attach of either transport, with their errors: UNAVAILABLE to
// retry, FAILED_PRECONDITION for a refusal).
absl::StatusOr<std::unique_ptr<kernels::GroupControl>> AttachGroupControl(
    const TpGroupOptions& options, const std::function<absl::Status(absl::string_view leader_identity)>& check_identity);
// What the logs call the group: its shared-memory name, and the TCP address when it has one.
std::string GroupControlName(const TpGroupOptions& options);

}  // namespace nq::worker
