#include "services/worker/tp_control.h"

#include "absl/strings/str_cat.h"
#include "kernels/comm/shm_communicator.h"
#include "kernels/comm/tcp_communicator.h"

namespace nq::worker {
namespace {

template <typename Transport>
absl::StatusOr<std::unique_ptr<kernels::GroupControl>> AsGroupControl(
    absl::StatusOr<std::unique_ptr<Transport>> comm) {
  if (!comm.ok()) return comm.status();
  return std::unique_ptr<kernels::GroupControl>(*std::move(comm));
}

}  // namespace

absl::StatusOr<std::unique_ptr<kernels::GroupControl>> CreateGroupControl(const TpGroupOptions& options,
                                                                          uint64_t generation) {
  const int world = options.identity.world_size;
  const std::string identity = options.identity.Serialize();
  if (!options.tcp_address.empty()) {
    return AsGroupControl(kernels::TcpCommunicator::Create(
        kernels::TcpCommunicatorOptions{.address = options.tcp_address,
                                        .rank = 0,
                                        .world_size = world,
                                        .timeout = options.collective_timeout,
                                        .identity = identity,
                                        .stop = options.stop},
        generation));
  }
  return AsGroupControl(kernels::ShmCommunicator::Create(
      kernels::ShmCommunicatorOptions{.name = options.shm_name,
                                      .rank = 0,
                                      .world_size = world,
                                      .timeout = options.collective_timeout,
                                      .identity = identity,
                                      .stop = options.stop},
      generation));
}

absl::StatusOr<std::unique_ptr<kernels::GroupControl>> AttachGroupControl(
    const TpGroupOptions& options, const std::function<absl::Status(absl::string_view leader_identity)>& check_identity) {
  const int world = options.identity.world_size;
  if (!options.tcp_address.empty()) {
    return AsGroupControl(kernels::TcpCommunicator::Attach(
        kernels::TcpCommunicatorOptions{.address = options.tcp_address,
                                        .rank = options.rank,
                                        .world_size = world,
                                        .timeout = options.collective_timeout,
                                        .stop = options.stop},
        check_identity));
  }
  return AsGroupControl(kernels::ShmCommunicator::Attach(
      kernels::ShmCommunicatorOptions{.name = options.shm_name,
                                      .rank = options.rank,
                                      .world_size = world,
                                      .timeout = options.collective_timeout,
                                      .stop = options.stop},
      check_identity));
}

std::string GroupControlName(const TpGroupOptions& options) {
  return options.tcp_address.empty() ? options.shm_name : absl::StrCat(options.shm_name, " (tcp ", options.tcp_address, ")");
}

}  // namespace nq::worker
