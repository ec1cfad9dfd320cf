// The layer-major prefill's record reads through the streamer's io_uring store (issue #23): a
// batch of records (a layer's prefetch, or the reads it missed) goes out at once, O_DIRECT and
// in pieces many deep, as the streamer reads slots, instead of one pread after another through
// the page cache (which a prefill reading a GLM-5 layer's 2.4 GB would also flood). Every record
// is checked against its checksum in the index (XXH3-128, else SHA-256) before it counts.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/release/prefill_experts.h"
#include "services/streamer/record_store.h"

namespace nq::worker {

class RecordStorePrefillReader final : public release::PrefillRecordReader {
 public:
  // Opens rank `rank`'s record files of the release at `release_dir` (its manifest and indexes
  // checked against COMPLETE) with `queue_depth` records in flight. The errors of
  // streamer::RecordStore::Open (io_uring unavailable among them).
  static absl::StatusOr<std::unique_ptr<RecordStorePrefillReader>> Open(const std::string& release_dir, uint32_t rank,
                                                                        unsigned queue_depth = 8);

  std::vector<absl::Status> ReadMany(uint32_t layer, std::span<const release::PrefillRecordRead> reads) override;
  // Records read through the store so far (tests: the prefill went this way).
  uint64_t reads_issued() const { return store_->reads_issued(); }

 private:
  RecordStorePrefillReader(std::unique_ptr<streamer::RecordStore> store, uint32_t rank)
      : store_(std::move(store)), rank_(rank) {}

  std::unique_ptr<streamer::RecordStore> store_;
  const uint32_t rank_;
};

}  // namespace nq::worker
