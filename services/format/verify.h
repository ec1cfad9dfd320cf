// nq verify: hash every range of a release and list what differs (DESIGN.md section 5).
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "services/format/release_reader.h"

namespace nq::format {

// Opens `dir` without the size check (a truncated file is reported, not refused) and
// hashes manifest.json and the rank indexes against COMPLETE and every record range and
// resident file against its index. An error status only when the release cannot be read
// at all (no COMPLETE, malformed manifest or index); differences are in the report, whose
// ToString() lists one "rank R layer L FILE: PROBLEM" line each.
// `progress` (may be empty): Release::Verify's.
absl::StatusOr<VerifyReport> VerifyRelease(const std::string& dir,
                                           const std::function<void(const ProgressState&)>& progress = {});

}  // namespace nq::format
