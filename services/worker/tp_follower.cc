#include "services/worker/tp_follower.h"

#include <spdlog/spdlog.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/metrics/registry.h"
#include "services/common/status_macros.h"
#include "services/worker/step_command.h"
#include "services/worker/tp_control.h"

namespace nq::worker {
namespace {

// How often a rank without a group looks for one.
constexpr absl::Duration kAttachPoll = absl::Milliseconds(50);

}  // namespace

TpFollower::TpFollower(TpGroupOptions options, GroupCommunicator* group, model::Model* model, SlotRuntime* slots,
                       std::function<void(bool joined)> on_joined)
    : options_(std::move(options)), group_(group), model_(model), slots_(slots), on_joined_(std::move(on_joined)) {}

absl::Status TpFollower::Run() {
  std::string last_wait;
  while (!(options_.stop != nullptr && options_.stop->load())) {
    absl::StatusOr<std::unique_ptr<kernels::GroupControl>> comm = AttachGroupControl(
        options_, [this](absl::string_view leader) { return options_.identity.CheckAgainstLeader(leader); });
    if (!comm.ok()) {
      if (comm.status().code() == absl::StatusCode::kFailedPrecondition) {
        return Annotate(comm.status(), absl::StrCat("rank ", options_.rank, " refused by tensor-parallel group ",
                                                    GroupControlName(options_)));
      }
      if (comm.status().code() != absl::StatusCode::kUnavailable) return comm.status();
      if (comm.status().message() != last_wait) {
        last_wait = std::string(comm.status().message());
        spdlog::info("rank {}: waiting for rank 0: {}", options_.rank, last_wait);
      }
      absl::SleepFor(kAttachPoll);
      continue;
    }
    last_wait.clear();
    // A new group: the leader starts its first sequence with an empty cache, so do we; and with
    // a slot table every rank holds alike (the leader clears its own when it forms the group).
    model_->ResetCache();
    if (slots_ != nullptr) (void)slots_->ResetForNewGroup();
    // On CUDA the model's collectives run over NCCL: rank 0's unique id arrives over the segment.
    std::unique_ptr<TpDataPlane> plane;
    std::unique_ptr<TpWatchdog> watchdog;
    if (options_.data_plane != nullptr) {
      absl::StatusOr<std::unique_ptr<TpDataPlane>> joined_plane =
          FollowDataPlane(*options_.data_plane, **comm, options_.collective_timeout);
      if (!joined_plane.ok()) {
        // A refused bootstrap, or a join NCCL calls invalid usage (two ranks on one GPU): retrying
        // cannot cure either.
        if (joined_plane.status().code() == absl::StatusCode::kFailedPrecondition ||
            joined_plane.status().code() == absl::StatusCode::kInvalidArgument) {
          return Annotate(joined_plane.status(), absl::StrCat("rank ", options_.rank, " refused by tensor-parallel group ",
                                                              GroupControlName(options_)));
        }
        spdlog::warn("rank {}: tensor-parallel group {} (generation {}): {}; waiting for the next", options_.rank,
                     GroupControlName(options_), (*comm)->generation(), joined_plane.status().ToString());
        continue;
      }
      plane = *std::move(joined_plane);
      watchdog = std::make_unique<TpWatchdog>(comm->get(), plane.get(), kDataPlaneWatch);
    }
    group_->Set(plane != nullptr ? static_cast<kernels::Communicator*>(plane.get()) : comm->get());
    spdlog::info("rank {}: joined tensor-parallel group {} (generation {}) of {} ranks", options_.rank,
                 GroupControlName(options_), (*comm)->generation(), options_.identity.world_size);
    on_joined_(true);
    const absl::Status why = Follow(**comm, plane.get());
    group_->Set(nullptr);
    watchdog.reset();
    plane.reset();
    on_joined_(false);
    if (why.code() == absl::StatusCode::kCancelled) break;
    spdlog::warn("rank {}: left tensor-parallel group (generation {}): {}; waiting for the next", options_.rank,
                 (*comm)->generation(), why.ToString());
    model_->ResetCache();
  }
  return absl::OkStatus();
}

absl::Status TpFollower::Follow(kernels::GroupControl& comm, TpDataPlane* plane) {
  std::vector<std::byte> header(kStepCommandHeaderBytes);
  for (;;) {
    // Between requests the leader sends nothing: wait as long as the group lives.
    RETURN_IF_ERROR(comm.BroadcastBytes(header, 0, absl::InfiniteDuration()));
    absl::StatusOr<StepCommand> command = DecodeStepHeader(header, model_->max_tokens());
    if (command.ok() && StepPayloadBytes(*command) > 0) {
      std::vector<std::byte> payload(StepPayloadBytes(*command));
      RETURN_IF_ERROR(comm.BroadcastBytes(payload, 0, options_.collective_timeout));
      if (absl::Status s = DecodeStepPayload(payload, *command); !s.ok()) command = s;
    }
    absl::Status applied = command.status();
    if (command.ok() && slots_ != nullptr) {
      // The leader's table for this step, then the step: both ranks read the same slots.
      slots_->BeginRelayedStep(static_cast<uint32_t>(command->step), command->slot_updates);
      applied = ApplyStepCommand(*command, *model_);
      slots_->EndStep();
    } else if (command.ok()) {
      if (!command->slot_updates.empty()) {
        applied = absl::FailedPreconditionError("the leader relays slot-table updates; this rank streams no experts");
      } else {
        applied = ApplyStepCommand(*command, *model_);
      }
    }
    // A step whose collectives an aborted data plane cut short computed garbage: say why.
    if (applied.ok() && plane != nullptr) applied = plane->Health();
    const double collective_seconds = group_->TakeCollectiveSeconds();
    if (applied.ok() && command->op == StepCommand::Op::kForward && command->step > 0) {
      TpStepCollectiveSeconds().Observe(collective_seconds);
    }
    if (!applied.ok()) {
      // The leader's collectives would wait for this rank in vain: break the group with why.
      const std::string reason = absl::StrCat("rank ", options_.rank, ": ", applied.message());
      comm.Break(reason);
      return absl::Status(applied.code(), reason);
    }
  }
}

}  // namespace nq::worker
