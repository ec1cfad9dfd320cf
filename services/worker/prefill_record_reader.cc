#include "services/worker/prefill_record_reader.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {

absl::StatusOr<std::unique_ptr<RecordStorePrefillReader>> RecordStorePrefillReader::Open(const std::string& release_dir,
                                                                                        uint32_t rank,
                                                                                        unsigned queue_depth) {
  // Checked on this thread (no verifier pool): the prefill waits for the whole batch anyway,
  // and the store checks a record while the next ones are in flight.
  ASSIGN_OR_RETURN(std::unique_ptr<streamer::RecordStore> store,
                   streamer::RecordStore::Open({release_dir}, {.queue_depth = queue_depth}));
  return std::unique_ptr<RecordStorePrefillReader>(new RecordStorePrefillReader(std::move(store), rank));
}

std::vector<absl::Status> RecordStorePrefillReader::ReadMany(uint32_t layer,
                                                             std::span<const release::PrefillRecordRead> reads) {
  std::vector<absl::Status> statuses(reads.size());
  std::vector<bool> pending(reads.size(), false);
  size_t submitted = 0;
  for (size_t i = 0; i < reads.size(); ++i) {
    if (reads[i].expert < 0) {
      statuses[i] = absl::InvalidArgumentError(absl::StrCat("expert ", reads[i].expert));
      continue;
    }
    statuses[i] = store_->Submit({.rank = rank_,
                                  .layer = layer,
                                  .expert = static_cast<uint32_t>(reads[i].expert),
                                  .destination = reads[i].destination,
                                  .tag = i});
    pending[i] = statuses[i].ok();
    if (pending[i]) ++submitted;
  }
  for (size_t done = 0; done < submitted; ++done) {
    absl::StatusOr<streamer::RecordCompletion> completion = store_->Wait();
    if (!completion.ok()) {
      // The ring failed: what has not completed is lost with it.
      for (size_t i = 0; i < reads.size(); ++i) {
        if (pending[i]) statuses[i] = completion.status();
      }
      break;
    }
    statuses[completion->tag] = completion->status;
    pending[completion->tag] = false;
  }
  return statuses;
}

}  // namespace nq::worker
