// The transport a tensor-parallel group's model collectives run on, when it is not the group's
// control channel itself. On the CPU backend the shared-memory segment carries both (no data
// plane: the model's collectives run on the group control, kernels/comm/group_control.h). On CUDA the collectives run over
// NCCL on the worker's stream (services/worker/tp_nccl.h) while the segment stays the control
// channel: rendezvous, identity checks, liveness and step commands (tp_leader.h says why).
//
// Forming a group's data plane: rank 0 makes a bootstrap (a new NCCL unique id) and sends it over
// the control channel (tp_bootstrap.h); every rank then joins. A join blocks until every rank has
// joined, so it is handed `peers_alive` (the control group's liveness): a rank that dies or is
// refused while the others wait in the join breaks the control group, and the join gives up
// instead of hanging.
//
// While the group serves, a TpWatchdog (another thread) polls the control group's liveness and
// the data plane's health: a device collective waiting for a dead peer never returns by itself,
// so the watchdog aborts the data plane, which unblocks the device and fails the request with the
// reason.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/comm/communicator.h"
#include "kernels/comm/group_control.h"
#include "services/common/metrics/registry.h"
#include "services/worker/tp_bootstrap.h"

namespace nq::worker {

class TpDataPlane : public kernels::Communicator {
 public:
  // OK while the transport is healthy; else why not. Called from the watchdog's thread.
  virtual absl::Status Health() = 0;
  // From any thread: fails pending and later collectives with `reason` and releases anything
  // waiting on the device for them. Idempotent; the first reason is kept.
  virtual void Abort(absl::string_view reason) = 0;
};

struct TpDataPlaneFactory {
  TpTransport transport = TpTransport::kNccl;
  int32_t nccl_version = 0;  // this process's NCCL library (ncclGetVersion)
  // Rank 0, at each group it forms: the bootstrap's id (ncclGetUniqueId).
  std::function<absl::StatusOr<kernels::NcclUniqueId>()> new_id;
  // Every rank, once the bootstrap has arrived: joins the data plane, checking `peers_alive`
  // while it waits for the others (its error ends the join).
  std::function<absl::StatusOr<std::unique_ptr<TpDataPlane>>(const TpBootstrap& bootstrap, int rank,
                                                            const std::function<absl::Status()>& peers_alive)>
      join;
};

// Rank 0 of a formed control group: makes the bootstrap, sends it, joins. A failed join breaks
// the control group (the followers stop waiting in theirs).
absl::StatusOr<std::unique_ptr<TpDataPlane>> LeadDataPlane(const TpDataPlaneFactory& factory,
                                                           kernels::GroupControl& control, absl::Duration timeout);
// Rank > 0 of a joined control group: receives and checks the bootstrap (FAILED_PRECONDITION
// refusals, tp_bootstrap.h), joins. A failed join breaks the control group.
absl::StatusOr<std::unique_ptr<TpDataPlane>> FollowDataPlane(const TpDataPlaneFactory& factory,
                                                             kernels::GroupControl& control,
                                                             absl::Duration timeout);

// How often each rank's TpWatchdog looks at the ranks and the transport during a sequence (the
// leader's group manager cannot: a sequence holds its mutex). A dead rank's step is aborted
// within this.
inline constexpr absl::Duration kDataPlaneWatch = absl::Milliseconds(50);

// nq_worker_tp_step_collective_seconds: time inside collectives per decode step, on every rank.
metrics::Histogram& TpStepCollectiveSeconds();

// Polls `control.PeersAlive()` and `plane.Health()` every `interval` on its own thread; on the
// first failure aborts `plane` and breaks `control` with the reason, then stops. Both outlive it.
class TpWatchdog {
 public:
  TpWatchdog(kernels::GroupControl* control, TpDataPlane* plane, absl::Duration interval);
  ~TpWatchdog();  // stops the thread
  TpWatchdog(const TpWatchdog&) = delete;
  TpWatchdog& operator=(const TpWatchdog&) = delete;

 private:
  void Watch();

  kernels::GroupControl* const control_;
  TpDataPlane* const plane_;
  const absl::Duration interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace nq::worker
