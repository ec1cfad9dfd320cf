// Checks records against their per-record sha256 (rank index, format version 2) on threads of
// its own, so the hashing of one record overlaps the reads of the next ones (issue #22: every
// record read is verified before it can become READY, and the cost is kept off the read path's
// critical bandwidth). SHA-256 runs at about 1.5 GB/s per core with the SHA extensions, below
// what one NVMe drive reads; spreading records over a few threads keeps it there.
//
// One verifier per streamer process, shared by every session's RecordStore. Jobs run in the
// order given, on whichever thread is free; `done` is called on that thread.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace nq::streamer {

class RecordVerifier {
 public:
  // `done(ok)`: true when sha256(bytes) equals `expected_sha256` (lower-case hex).
  using Done = std::function<void(bool ok)>;

  // INVALID_ARGUMENT for 0 threads (verify inline instead: RecordStoreOptions::verifier null).
  static absl::StatusOr<std::shared_ptr<RecordVerifier>> Create(unsigned threads);
  // Finishes the queued jobs, then joins the threads.
  ~RecordVerifier();
  RecordVerifier(const RecordVerifier&) = delete;
  RecordVerifier& operator=(const RecordVerifier&) = delete;

  // `bytes` must stay valid and unchanged until `done` has returned.
  void Submit(std::span<const std::byte> bytes, std::string expected_sha256, Done done);
  unsigned threads() const { return static_cast<unsigned>(threads_.size()); }

 private:
  struct Job {
    std::span<const std::byte> bytes;
    std::string expected;
    Done done;
  };
  RecordVerifier() = default;
  void Run();

  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// sha256(bytes) == expected_sha256 (lower-case hex): the check RecordVerifier runs, for
// callers that verify inline.
bool RecordMatches(std::span<const std::byte> bytes, const std::string& expected_sha256);

}  // namespace nq::streamer
