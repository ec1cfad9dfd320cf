#include "services/worker/tp_data_plane.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "services/common/metrics/buckets.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

// Breaks the control group when a join failed, so the other ranks' joins end too; the status
// keeps its code with the rank prefixed.
absl::Status JoinFailed(kernels::GroupControl& control, const absl::Status& why) {
  const std::string reason =
      absl::StrCat("rank ", control.rank(), " could not join the collectives' transport: ", why.message());
  control.Break(reason);
  return absl::Status(why.code(), reason);
}

}  // namespace

absl::StatusOr<std::unique_ptr<TpDataPlane>> LeadDataPlane(const TpDataPlaneFactory& factory,
                                                           kernels::GroupControl& control, absl::Duration timeout) {
  if (!factory.new_id || !factory.join) return absl::InternalError("the data-plane factory is incomplete");
  TpBootstrap bootstrap{.transport = factory.transport,
                        .world_size = static_cast<uint32_t>(control.world_size()),
                        .generation = control.generation(),
                        .nccl_version = factory.nccl_version};
  absl::StatusOr<kernels::NcclUniqueId> id = factory.new_id();
  if (!id.ok()) return JoinFailed(control, id.status());
  bootstrap.id = *id;
  RETURN_IF_ERROR(SendTpBootstrap(control, bootstrap, timeout));
  absl::StatusOr<std::unique_ptr<TpDataPlane>> plane =
      factory.join(bootstrap, 0, [&control] { return control.PeersAlive(); });
  if (!plane.ok()) return JoinFailed(control, plane.status());
  return plane;
}

absl::StatusOr<std::unique_ptr<TpDataPlane>> FollowDataPlane(const TpDataPlaneFactory& factory,
                                                             kernels::GroupControl& control,
                                                             absl::Duration timeout) {
  if (!factory.join) return absl::InternalError("the data-plane factory is incomplete");
  ASSIGN_OR_RETURN(const TpBootstrap bootstrap,
                   ReceiveTpBootstrap(control,
                                      TpBootstrapExpectation{.transport = factory.transport,
                                                             .world_size = static_cast<uint32_t>(control.world_size()),
                                                             .generation = control.generation(),
                                                             .nccl_version = factory.nccl_version},
                                      timeout));
  absl::StatusOr<std::unique_ptr<TpDataPlane>> plane =
      factory.join(bootstrap, control.rank(), [&control] { return control.PeersAlive(); });
  if (!plane.ok()) return JoinFailed(control, plane.status());
  return plane;
}

TpWatchdog::TpWatchdog(kernels::GroupControl* control, TpDataPlane* plane, absl::Duration interval)
    : control_(control), plane_(plane), interval_(interval) {
  thread_ = std::thread([this] { Watch(); });
}

TpWatchdog::~TpWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void TpWatchdog::Watch() {
  const auto interval = absl::ToChronoNanoseconds(interval_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, interval, [this] { return stopping_; })) {
    absl::Status status = control_->PeersAlive();
    if (status.ok()) status = plane_->Health();
    if (status.ok()) continue;
    const std::string reason = std::string(status.message());
    spdlog::error("rank {}: tensor-parallel group failed ({}); aborting its collectives", control_->rank(), reason);
    plane_->Abort(reason);
    control_->Break(reason);
    return;
  }
}

metrics::Histogram& TpStepCollectiveSeconds() {
  return metrics::Registry::Default()
      .Histogram("nq_worker_tp_step_collective_seconds",
                 "Time inside tensor-parallel collectives during one decode step (compare "
                 "nq_worker_step_seconds{phase=\"decode\"} for the share of a step spent communicating)",
                 metrics::ExponentialBuckets(1e-5, 2, 18))
      .Get();
}

}  // namespace nq::worker
