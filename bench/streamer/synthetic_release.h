// A synthetic NestQuant release for record_read_bench: 1 rank, 32 experts of 1 MiB records per
// layer (random bytes), as many layers as make about `megabytes`.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace nq::streamer::bench {

// Writes the release into `dir`, or completes one an earlier run left there (layers already
// written are kept).
absl::Status WriteSyntheticRelease(const std::string& dir, uint64_t megabytes);

}  // namespace nq::streamer::bench
