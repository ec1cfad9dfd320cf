#include "services/streamer/remote_rank.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::streamer {

absl::StatusOr<std::shared_ptr<RegisteredWorker>> RemoteRank(const nq::v1::PeerRankHello& hello,
                                                             const std::string& release_id,
                                                             std::function<bool(const nq::v1::LoadOrder&)> order_load) {
  const nq::v1::RegisterWorkerRequest& r = hello.registration();
  if (r.world_size() < 2 || r.rank() >= r.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", r.rank(), " of world size ", r.world_size(), " is not a rank of a tensor-parallel group"));
  }
  if (r.tp_group().empty()) return absl::InvalidArgumentError(absl::StrCat("rank ", r.rank(), " names no group"));
  if (r.rank() == 0) {
    return absl::FailedPreconditionError(absl::StrCat("rank 0 of tensor-parallel group ", r.tp_group(),
                                                      " is linked from another streamer; the streamer rank 0 "
                                                      "registers with decides, so rank 0 cannot be remote"));
  }
  if (release_id.empty()) {
    return absl::FailedPreconditionError("this streamer has no release (--records_dir), so it cannot decide loads");
  }
  if (r.release_id() != release_id) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", r.rank(), " of tensor-parallel group ", r.tp_group(),
                                                      " serves release '", r.release_id(),
                                                      "'; the deciding streamer serves '", release_id, "'"));
  }
  ASSIGN_OR_RETURN(SlotGeometry geometry, SlotGeometry::FromProto(r.geometry()));
  auto rank = std::make_shared<RegisteredWorker>();
  rank->worker_id = absl::StrCat(r.tp_group(), ":r", r.rank(), "@", r.hostname().empty() ? "peer" : r.hostname());
  rank->rank = r.rank();
  rank->world_size = r.world_size();
  rank->tp_group = r.tp_group();
  rank->pid = r.pid();
  rank->hostname = r.hostname();
  rank->release_id = r.release_id();
  rank->geometry = std::move(geometry);
  rank->order_load = std::move(order_load);
  return rank;
}

}  // namespace nq::streamer
