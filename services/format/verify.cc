#include "services/format/verify.h"

#include "services/common/status_macros.h"

namespace nq::format {

absl::StatusOr<VerifyReport> VerifyRelease(const std::string& dir,
                                           const std::function<void(const ProgressState&)>& progress) {
  ASSIGN_OR_RETURN(Release release, Release::Open(dir, OpenOptions{.check_sizes = false}));
  return release.Verify(progress);
}

}  // namespace nq::format
