// Backend's side-work state (kernels/backend.h): the order of Begin / End / Join is checked here,
// once for every backend, and so is what may run on the side (the op wrappers call the two
// refusals below); the hooks only move streams.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"

namespace nq::kernels {

absl::Status Backend::RefuseOnSide(absl::string_view what) const {
  if (!OnSide()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(what, " cannot run on the side stream (Backend::BeginSideWork lists the ops that can)"));
}

absl::Status Backend::RefuseWithSideWorkOpen(absl::string_view what) const {
  if (!SideWorkOpen()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, " while side work is open (JoinSideWork first)"));
}

absl::Status Backend::BeginSideWork() {
  if (side_work_ == SideWork::kOnSide) {
    return absl::FailedPreconditionError("BeginSideWork: side work is already open (end it first)");
  }
  RETURN_IF_ERROR(DoBeginSideWork());
  side_work_ = SideWork::kOnSide;
  return absl::OkStatus();
}

absl::Status Backend::ContinueSideWork() {
  if (side_work_ != SideWork::kForked) {
    return absl::FailedPreconditionError("ContinueSideWork: no ended side work to continue");
  }
  RETURN_IF_ERROR(DoContinueSideWork());
  side_work_ = SideWork::kOnSide;
  return absl::OkStatus();
}

absl::Status Backend::EndSideWork() {
  if (side_work_ != SideWork::kOnSide) {
    return absl::FailedPreconditionError("EndSideWork: ops are not going to the side stream");
  }
  RETURN_IF_ERROR(DoEndSideWork());
  side_work_ = SideWork::kForked;
  return absl::OkStatus();
}

absl::Status Backend::JoinSideWork() {
  if (side_work_ == SideWork::kNone) return absl::FailedPreconditionError("JoinSideWork: no side work is open");
  // Closed even when the hook fails: the side's ops were issued, and leaving the state open would
  // refuse every later Begin for an error already reported.
  side_work_ = SideWork::kNone;
  return DoJoinSideWork();
}

}  // namespace nq::kernels
