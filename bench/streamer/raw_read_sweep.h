// The disk's peak read bandwidth on given files, for record_read_bench: a raw O_DIRECT reader
// (io_uring, read_fixed into registered buffers, no record store logic) reading every range
// front to back in blocks of one size with a fixed number of reads in flight. The benchmark
// sweeps block sizes and queue depths and takes the best as the peak (a queue-depth-1 reader
// is not the peak of an NVMe drive).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::streamer::bench {

// A byte range of a file to read: offset and bytes multiples of 4096 (O_DIRECT).
struct FileRange {
  std::string path;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct RawResult {
  uint64_t block_bytes = 0;
  unsigned queue_depth = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  double gb_per_s() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

// The files opened once with O_DIRECT (FAILED_PRECONDITION naming the file where the
// filesystem refuses it: without O_DIRECT the figures would measure the page cache).
class RawFiles {
 public:
  static absl::StatusOr<std::unique_ptr<RawFiles>> Open(const std::vector<FileRange>& ranges);
  ~RawFiles();
  RawFiles(const RawFiles&) = delete;
  RawFiles& operator=(const RawFiles&) = delete;

  // Reads every range `rounds` times, front to back in `block_bytes` blocks (the last block of
  // a range may be shorter), `queue_depth` reads always in flight; with `shuffle_seed`, the
  // blocks of each round in a random order instead (the store's access pattern, for
  // comparison). INVALID_ARGUMENT for a block that is not a positive multiple of 4096; the
  // io_uring errors; DATA_LOSS for a short read.
  absl::StatusOr<RawResult> Read(uint64_t block_bytes, unsigned queue_depth, unsigned rounds,
                                 std::optional<uint64_t> shuffle_seed = std::nullopt) const;
  uint64_t total_bytes() const;

 private:
  struct OpenRange {
    int fd = -1;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  RawFiles() = default;
  std::vector<OpenRange> files_;
};

}  // namespace nq::streamer::bench
