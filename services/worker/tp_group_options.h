// Settings shared by the leader and the followers of a tensor-parallel group of worker
// processes (services/worker/tp_leader.h, tp_follower.h).
#pragma once

#include <atomic>
#include <string>

#include "absl/time/time.h"
#include "services/worker/tp_data_plane.h"
#include "services/worker/tp_identity.h"

namespace nq::worker {

struct TpGroupOptions {
  // The group's shared-memory name ("/nq-tp-<leader gRPC port>" unless --tp_group names it).
  std::string shm_name;
  // Empty: the group's control channel (rendezvous, identity, step commands; and the CPU
  // backend's collectives) is the shared-memory object above, on one host. Set: TCP
  // (kernels/comm/tcp_communicator.h), so ranks may run on other hosts: rank 0 listens on this
  // host:port, the others connect to it.
  std::string tcp_address;
  int rank = 0;
  TpIdentity identity;  // identity.world_size is the group's
  // A collective whose peers do not all arrive within this breaks the group (a stuck rank).
  absl::Duration collective_timeout = absl::Seconds(60);
  const std::atomic<bool>* stop = nullptr;  // set on shutdown
  // Null: the model's collectives run on the shared-memory group itself (the CPU backend). Set
  // (the CUDA backend): each formed group also forms this data plane (NCCL), and the model's
  // collectives run on it (tp_data_plane.h). Outlives the leader or follower.
  const TpDataPlaneFactory* data_plane = nullptr;
};

}  // namespace nq::worker
