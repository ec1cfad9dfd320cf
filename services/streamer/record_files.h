// The record files of a NestQuant release and its mirrors, opened once per streamer process
// and shared by every worker session (issue #11): each copy validated through
// format::Release (COMPLETE present, every file listed and long enough, mirrors identical),
// every (copy, rank, layer) record file opened once, O_DIRECT where the filesystem allows it,
// and each file hashed at most once per process, on demand: by VerifyLayer, or before its first
// record is handed out by a store that does not check records (RecordStoreOptions::verify_hashes).
//
// Thread-safe: any number of RecordStores (one per session, each with its own io_uring ring
// and bounce buffers) read through one RecordFiles. Everything but the hash results is fixed
// at Open; the first caller that needs a file's hash computes it while later callers for the
// same file wait for that result (other files are not held up).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "services/format/release_reader.h"

namespace nq::streamer {

// O_DIRECT alignment of buffers, offsets and lengths (records are multiples of it).
inline constexpr size_t kDirectIoAlign = 4096;

enum class DirectIo {
  kAuto,  // O_DIRECT, buffered with a warning where the filesystem refuses it
  kOff,   // always buffered (page cache)
};

class RecordFiles {
 public:
  // One open record file of one copy. Fixed after Open but for its hash result, which only
  // RecordFiles touches.
  struct File {
    std::string path;
    int fd = -1;
    bool direct = false;
    uint32_t rank = 0;
    uint32_t layer = 0;
    uint64_t base_offset = 0;  // the layer's records.offset
    uint64_t range_bytes = 0;  // the layer's records.bytes
    uint64_t rec_bytes = 0;
    std::string sha256;
    // The layer's entry in its copy's rank index (the record checksums), owned by the Release
    // this object holds.
    const format::LayerEntry* entry = nullptr;

   private:
    friend class RecordFiles;
    mutable absl::Mutex mu;
    mutable std::optional<absl::Status> verified ABSL_GUARDED_BY(mu);
  };

  // `dirs`: the primary release directory, then mirrors holding identical copies.
  // INVALID_ARGUMENT for no directory; the Release::Open error of a copy
  // (FAILED_PRECONDITION without COMPLETE, DATA_LOSS for a missing/short file); DATA_LOSS for a
  // manifest or rank index that differs from COMPLETE (the record checksums come from it);
  // FAILED_PRECONDITION when a mirror's indexes differ from the primary's; the errno of an
  // open that fails.
  static absl::StatusOr<std::shared_ptr<RecordFiles>> Open(std::vector<std::string> dirs,
                                                           DirectIo mode = DirectIo::kAuto);
  ~RecordFiles();
  RecordFiles(const RecordFiles&) = delete;
  RecordFiles& operator=(const RecordFiles&) = delete;

  const format::Release& release() const { return copies_.front().release; }
  const std::string& dir(size_t copy) const { return copies_[copy].release.dir(); }
  size_t copies() const { return copies_.size(); }
  // Files read with O_DIRECT / buffered (after fallback or DirectIo::kOff), over all copies.
  size_t direct_files() const;
  size_t buffered_files() const;
  // Whether every file's index entry has record_xxh3 (RecordCheck::kFastest then never falls
  // back to SHA-256).
  bool all_have_record_xxh3() const;
  // The largest rec_bytes of any layer (sizes bounce buffers).
  uint64_t max_rec_bytes() const { return max_rec_bytes_; }
  // rec_bytes of a layer (NOT_FOUND for a layer the release lacks).
  absl::StatusOr<uint64_t> RecordBytes(uint32_t rank, uint32_t layer) const;
  // Copy `copy`'s file of (rank, layer), or nullptr when the release lacks the layer.
  const File* Find(size_t copy, uint32_t rank, uint32_t layer) const;

  // OK once `file`'s bytes match its sha256; DATA_LOSS naming the file otherwise. Hashes
  // the file the first time any caller asks, then answers from the cached result.
  absl::Status Verify(const File& file) const;
  // Verify for every copy's file of the layer (INVALID_ARGUMENT / NOT_FOUND for a layer
  // the release lacks).
  absl::Status VerifyLayer(uint32_t rank, uint32_t layer) const;
  // True once every copy's file of the layer has been hashed and matched.
  bool LayerVerified(uint32_t rank, uint32_t layer) const;
  // Files this process has hashed so far (each at most once).
  uint64_t files_hashed() const { return files_hashed_.load(); }

 private:
  struct Copy {
    format::Release release;
    // (rank, layer) -> file; held by pointer so File pointers stay valid.
    std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<File>> files;
  };

  explicit RecordFiles(std::vector<Copy> copies) : copies_(std::move(copies)) {}
  absl::Status OpenFiles(DirectIo mode);

  std::vector<Copy> copies_;
  uint64_t max_rec_bytes_ = 0;
  mutable std::atomic<uint64_t> files_hashed_{0};
};

}  // namespace nq::streamer
