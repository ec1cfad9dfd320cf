// Rank 0 of a tensor-parallel group of worker processes (DESIGN.md section 2: "Rank 0 leads:
// it serves nq.v1.Worker to the router and drives the other ranks through the communicator").
//
// Why the shared-memory segment is also the control channel (no gRPC service between ranks):
// the CPU backend's collectives already need every rank on this host mapping one segment, so
// rendezvous (the segment's name), identity checks (rank 0's identity in its header), liveness
// (robust alive locks: a SIGKILLed rank is seen at once) and the per-step commands (a
// BroadcastBytes round) ride on it with no second transport to secure, time out and keep in
// step. Ranks on other hosts (NCCL) would need a network rendezvous; that is not built.
// On CUDA the model's collectives run over NCCL (tp_data_plane.h): each group the manager forms
// also gets a new NCCL communicator, whose unique id travels over the segment, and a watchdog
// that aborts it when a rank dies mid-step.
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
#include "absl/synchronization/mutex.h"
#include "kernels/comm/group_control.h"
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
  // Forms the data plane of the group that just became ready (mu_ held). False on failure: the
  // group is dissolved and re-formed.
  bool FormDataPlane();
  // Forgets the group (mu_ held): the model's pointer first, then the watchdog, plane, segment.
  void Dissolve();
  // Health of the formed group: the ranks' liveness, and the data plane's transport.
  absl::Status GroupAlive();
  void SetWaitingFor(std::string why);
  // waiting_for_, and how the last group broke when that is something else.
  std::string NotFormedReason() const;

  const TpGroupOptions options_;
  GroupCommunicator* const group_;
  const std::function<void(bool)> on_ready_;
  std::atomic<bool> stopping_{false};
  std::thread manager_;

  std::mutex mu_;  // held by the manager for a pass, by a Lease for a sequence
  // Group state; torn down in this order by Dissolve (the watchdog watches the two others).
  std::unique_ptr<kernels::GroupControl> comm_;
  std::unique_ptr<TpDataPlane> plane_;  // with options_.data_plane only
  std::unique_ptr<TpWatchdog> watchdog_;
  bool ready_ = false;
  // ready_, readable without mu_: while the group forms the manager holds mu_ through the join
  // (an NCCL init may take up to --tp_timeout_s), and Acquire must refuse at once meanwhile.
  std::atomic<bool> formed_{false};
  bool fresh_ = false;
  uint64_t generation_ = 0;
  // Why the group is not formed, for Acquire's error; its own lock, so Acquire reads it while
  // the manager holds mu_ through a join.
  mutable absl::Mutex why_mu_;
  std::string waiting_for_ ABSL_GUARDED_BY(why_mu_) = "its ranks have not joined yet";
  // How the last formed group broke, until one forms again: the next group's wait for its ranks
  // would otherwise hide why serving stopped.
  std::string broke_because_ ABSL_GUARDED_BY(why_mu_);
  absl::Time last_waiting_log_ = absl::InfinitePast();
  // Whether the last mirrored command was a decode step (kForward past the prefill): its collectives' time is observed at
  // the next Mirror (the step boundary the leader sees).
  bool last_was_decode_ = false;
};

}  // namespace nq::worker
