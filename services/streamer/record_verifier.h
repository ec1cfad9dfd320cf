// Checks records against their checksum in the rank index on threads of its own, so the hashing
// of one record overlaps the reads of the next ones (issue #22: every record read is verified
// before it can become READY, and the cost is kept off the read path's critical bandwidth).
// The checksum is the index's XXH3-128 where it has one (about 14 GB/s a core: one thread
// keeps up with a drive), else its SHA-256 (about 1.5 GB/s a core with the SHA extensions,
// below what one NVMe drive reads; a few threads are needed there).
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
#include "services/format/rank_index.h"

namespace nq::streamer {

using format::RecordDigest;
using format::RecordMatches;

// Which checksum the streamer checks records with (--record_check).
enum class RecordCheck {
  kFastest,  // XXH3-128 where the index has it, SHA-256 otherwise
  kSha256,   // SHA-256 always (a cryptographic check; several verifier threads per drive)
};

class RecordVerifier {
 public:
  // `done(ok)`: true when `bytes` match `expected`.
  using Done = std::function<void(bool ok)>;

  // INVALID_ARGUMENT for 0 threads (verify inline instead: RecordStoreOptions::verifier null).
  static absl::StatusOr<std::shared_ptr<RecordVerifier>> Create(unsigned threads);
  // Finishes the queued jobs, then joins the threads.
  ~RecordVerifier();
  RecordVerifier(const RecordVerifier&) = delete;
  RecordVerifier& operator=(const RecordVerifier&) = delete;

  // `bytes` must stay valid and unchanged until `done` has returned.
  void Submit(std::span<const std::byte> bytes, RecordDigest expected, Done done);
  unsigned threads() const { return static_cast<unsigned>(threads_.size()); }

 private:
  struct Job {
    std::span<const std::byte> bytes;
    RecordDigest expected;
    Done done;
  };
  RecordVerifier() = default;
  void Run();

  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};


}  // namespace nq::streamer
