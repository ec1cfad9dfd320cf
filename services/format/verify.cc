#include "services/format/verify.h"

#include "services/common/status_macros.h"

namespace nq::format {

absl::StatusOr<VerifyReport> VerifyRelease(const std::string& dir) {
  ASSIGN_OR_RETURN(Release release, Release::Open(dir, OpenOptions{.check_sizes = false}));
  return release.Verify();
}

}  // namespace nq::format
