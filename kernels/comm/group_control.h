// The control side of a tensor-parallel group of worker processes: rendezvous (rank 0 forms a
// group, the others join it, each side checking the other), the leader's step commands
// (BroadcastBytes), liveness and breaking. Two transports behind it: ShmCommunicator (one host's
// shared memory) and TcpCommunicator (a TCP connection from each rank to rank 0, so ranks may run
// on other hosts). Both are Communicators too: the CPU backend's model collectives run on them
// (the GPU's run on NCCL, services/worker/tp_data_plane.h).
//
// Contract (both transports): a broken group stays broken and every later collective fails with
// why (UNAVAILABLE for a dead or departed peer, DEADLINE_EXCEEDED for a timeout,
// FAILED_PRECONDITION for ranks posting different collectives); rank 0 re-forms by making a new
// one. One thread drives the collectives; PeersAlive and Break may be called from another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/comm/communicator.h"

namespace nq::kernels {

class GroupControl : public Communicator {
 public:
  // Rank 0's count of the groups it formed (a rank joining takes it from rank 0).
  virtual uint64_t generation() const = 0;
  // Broadcast of raw bytes (the leader's step commands). The first part waits up to `first_wait`
  // (absl::InfiniteDuration(): as long as the peers live) instead of the timeout, so a follower
  // can idle in it between requests.
  virtual absl::Status BroadcastBytes(std::span<std::byte> data, int root, absl::Duration first_wait) = 0;
  // Rank 0: waits until every rank has joined (then the group is ready) or `timeout` passes
  // (DEADLINE_EXCEEDED naming the missing ranks). Ranks that die while joining free their place.
  virtual absl::Status WaitForPeers(absl::Duration timeout) = 0;
  // Rank 0: refusals since the last call ("rank 1 (pid 123): ..."), for its log.
  virtual std::vector<std::string> TakeRefusals() = 0;
  // OK while the group is ready or forming and every joined peer lives; else why not (and the
  // group is then broken).
  virtual absl::Status PeersAlive() = 0;
  // Breaks the group with `reason` (the first reason wins) and wakes every waiter.
  virtual void Break(absl::string_view reason) = 0;
};

}  // namespace nq::kernels
