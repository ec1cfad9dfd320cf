// Rank 0 of a tensor-parallel group of worker processes (DESIGN.md section 2: "Rank 0 leads:
// it serves nq.v1.Worker to the router and drives the other ranks through the communicator").
//
// Why the shared-memory segment is also the control channel (no gRPC service between ranks):
// the CPU backend's collectives already need every rank on this host mapping one segment, so
// rendezvous (the segment's name), identity checks (rank 0's identity in its header), liveness
// (robust alive locks: a SIGKILLed rank is seen at once) and the per-step commands (a
// BroadcastBytes round) ride on it with no second transport to secure, time out and keep in
// step. Ranks on other hosts (NCCL) would need a network rendezvous; that is not built.
//
// A manager thread forms the group (creates the segment, waits for ranks 1..W-1 to join),
// watches it while idle, and re-forms it when a rank dies or leaves: meanwhile `on_ready(false)`
// (main() turns health NOT_SERVING) and Acquire() fails UNAVAILABLE. A sequence holds the group
// through a Lease; a rank dying mid-sequence fails that sequence's collective with the reason.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "kernels/comm/shm_communicator.h"
#include "services/worker/group_communicator.h"
#include "services/worker/step_command.h"
#include "services/worker/tp_group_options.h"

namespace nq::worker {

class TpLeader final : public StepMirror {
 public:
  // `group` is the communicator the leader's model was loaded with; the leader points it at
  // each group it forms. `on_ready` is called from the manager thread.
  TpLeader(TpGroupOptions options, GroupCommunicator* group, std::function<void(bool ready)> on_ready);
  ~TpLeader() override;  // stops the manager and breaks the group

  void Start();

  // The group, held for one sequence.
  class Lease {
   public:
    explicit Lease(std::unique_lock<std::mutex> lock, bool fresh) : lock_(std::move(lock)), fresh_(fresh) {}
    // True for the first sequence of a newly formed group: the other ranks' caches are empty,
    // so the leader must forget its cached prefix too.
    bool fresh() const { return fresh_; }

   private:
    std::unique_lock<std::mutex> lock_;
    bool fresh_;
  };
  // UNAVAILABLE (saying which ranks are missing) while the group is not formed.
  absl::StatusOr<Lease> Acquire();

  // Sends `command` to every other rank (under a Lease).
  absl::Status Mirror(const StepCommand& command) override;

 private:
  void Manage();
  // One pass of the manager (mu_ held): form, or check the formed group.
  void Tick();

  const TpGroupOptions options_;
  GroupCommunicator* const group_;
  const std::function<void(bool)> on_ready_;
  std::atomic<bool> stopping_{false};
  std::thread manager_;

  std::mutex mu_;  // held by the manager for a pass, by a Lease for a sequence
  std::unique_ptr<kernels::ShmCommunicator> comm_;
  bool ready_ = false;
  bool fresh_ = false;
  uint64_t generation_ = 0;
  std::string waiting_for_;  // why the group is not formed (for Acquire's error)
  absl::Time last_waiting_log_ = absl::InfinitePast();
};

}  // namespace nq::worker
