// A rank > 0 of a tensor-parallel group of worker processes: joins the group rank 0 forms
// (services/worker/tp_leader.h says why the shared-memory segment is the channel), then runs
// each command the leader broadcasts (step_command.h) on its own shard, so its collectives pair
// with the leader's. When the group breaks (the leader or another rank died or left) it resets
// its cache and waits for the next group; a refusal (another world size, release, model...)
// ends Run() with the reason, since waiting cannot cure it. On CUDA each group also forms its NCCL
// data plane (tp_data_plane.h) from the unique id rank 0 sends; a bootstrap this rank cannot use
// (another NCCL version, transport or world size) is a refusal too.
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "kernels/comm/group_control.h"
#include "services/model/model.h"
#include "services/worker/group_communicator.h"
#include "services/worker/tp_data_plane.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/tp_group_options.h"

namespace nq::worker {

class TpFollower {
 public:
  // `model` was loaded with `group` as its communicator; both outlive the follower.
  // `on_joined` reports membership changes (health).
  // `slots` (null without dynamic experts) applies the slot updates each command carries.
  TpFollower(TpGroupOptions options, GroupCommunicator* group, model::Model* model, SlotRuntime* slots,
             std::function<void(bool joined)> on_joined);

  // Joins, follows, re-joins, until options.stop is set (then OK). FAILED_PRECONDITION when
  // this rank is refused.
  absl::Status Run();

 private:
  // Runs the leader's commands until the group breaks; returns why. `plane`: the group's data
  // plane (null when the collectives run on `comm`).
  absl::Status Follow(kernels::GroupControl& comm, TpDataPlane* plane);

  const TpGroupOptions options_;
  GroupCommunicator* const group_;
  model::Model* const model_;
  SlotRuntime* const slots_;
  const std::function<void(bool)> on_joined_;
};

}  // namespace nq::worker
