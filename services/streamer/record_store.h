// The streamer's record store (DESIGN.md sections 4-5, issue #6): reads expert records of a
// NestQuant release from disk with io_uring, O_DIRECT, into caller or registered aligned
// buffers, at a configurable queue depth, spreading reads round-robin over several identical
// copies of the release (one per directory/drive).
//
//   ASSIGN_OR_RETURN(auto store, RecordStore::Open({"/nvme0/rel", "/nvme1/rel"}, {}));
//   RETURN_IF_ERROR(store->Submit({.rank = 0, .layer = 3, .expert = 7, .buffer_index = 0,
//                                  .tag = 42}));
//   ASSIGN_OR_RETURN(RecordCompletion done, store->Wait());   // done.tag == 42
//
// Open validates every copy through format::Release (COMPLETE present, every file listed and
// long enough) and requires the copies to hold the same release. Hashing is on demand: the
// index only has a sha256 per layer file, so before the first record of a (copy, rank,
// layer) is read its whole file is hashed once and the result cached; a file that fails
// makes every read of it complete with DATA_LOSS naming the file, so a bad record is never
// handed out as good. Files are opened with O_DIRECT; where the filesystem refuses it
// (EINVAL at open or on a probe read) the file is read buffered, with a warning naming it.
// Not thread-safe: one owner thread submits and reaps.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/format/release_reader.h"
#include "services/streamer/io_uring_reader.h"

namespace nq::streamer {

// O_DIRECT alignment of buffers, offsets and lengths (records are multiples of it).
inline constexpr size_t kDirectIoAlign = 4096;

enum class DirectIo {
  kAuto,  // O_DIRECT, buffered with a warning where the filesystem refuses it
  kOff,   // always buffered (page cache)
};

struct RecordStoreOptions {
  unsigned queue_depth = 8;  // reads in flight at once; more are queued in the store
  // Registered (fixed) aligned buffers the store owns, each as large as the largest
  // record; ReadRequest::buffer_index picks one.
  unsigned buffers = 0;
  DirectIo direct_io = DirectIo::kAuto;
  // Hash a layer file (once) before its first read is allowed to complete OK.
  bool verify_hashes = true;
};

struct ReadRequest {
  uint32_t rank = 0;
  uint32_t layer = 0;
  uint32_t expert = 0;
  // Where the record goes: a registered buffer (buffer_index >= 0), or `destination`,
  // exactly rec_bytes long and (for O_DIRECT) kDirectIoAlign-aligned.
  int buffer_index = -1;
  std::span<std::byte> destination = {};
  uint64_t tag = 0;  // returned in the completion
};

struct RecordCompletion {
  uint64_t tag = 0;
  absl::Status status;  // DATA_LOSS for a layer file that fails its hash or a short read
  double latency_seconds = 0;  // Submit to reap
  uint64_t bytes = 0;
  uint32_t copy = 0;  // which directory served it
};

class RecordStore {
 public:
  // `dirs`: the primary release directory, then mirrors holding identical copies.
  // INVALID_ARGUMENT for no directory, a zero queue depth; the Release::Open error of a
  // copy (FAILED_PRECONDITION without COMPLETE, DATA_LOSS for a missing/short file);
  // FAILED_PRECONDITION when a mirror's indexes differ from the primary's.
  static absl::StatusOr<std::unique_ptr<RecordStore>> Open(std::vector<std::string> dirs,
                                                           RecordStoreOptions options = {});
  ~RecordStore();
  RecordStore(const RecordStore&) = delete;
  RecordStore& operator=(const RecordStore&) = delete;

  const format::Release& release() const { return copies_.front().release; }
  size_t copies() const { return copies_.size(); }
  // Records each copy has served so far.
  std::vector<uint64_t> reads_per_copy() const;
  // Files read with O_DIRECT / buffered (after fallback or DirectIo::kOff).
  size_t direct_files() const;
  size_t buffered_files() const;
  // rec_bytes of a layer (NOT_FOUND for a layer the release lacks).
  absl::StatusOr<uint64_t> RecordBytes(uint32_t rank, uint32_t layer) const;
  // Registered buffer `index` (largest record size, kDirectIoAlign-aligned).
  std::span<std::byte> Buffer(unsigned index) const;

  // Queues a read. INVALID_ARGUMENT for a rank/layer/expert outside the release, a bad
  // buffer index, or a destination of the wrong size or alignment. Reads beyond the queue
  // depth wait inside the store and go out as earlier ones complete.
  absl::Status Submit(const ReadRequest& request);
  // Completions ready now (without blocking), in completion order.
  absl::StatusOr<std::vector<RecordCompletion>> Poll();
  // Blocks for the next completion; FAILED_PRECONDITION when nothing is outstanding.
  absl::StatusOr<RecordCompletion> Wait();
  size_t outstanding() const { return ready_.size() + pending_.size() + in_flight_.size(); }

  // Synchronous read of one record into `out` (rec_bytes, aligned as for Submit); other
  // completions reaped meanwhile stay queued for Poll/Wait.
  absl::Status ReadRecord(uint32_t rank, uint32_t layer, uint32_t expert,
                          std::span<std::byte> out);

  // Hashes every copy's file of the layer (once; cached). DATA_LOSS naming the file on a
  // mismatch.
  absl::Status VerifyLayer(uint32_t rank, uint32_t layer);
  // True once every copy's file of the layer has been hashed and matched.
  bool LayerVerified(uint32_t rank, uint32_t layer) const;

 private:
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
    std::optional<absl::Status> verified;  // cached hash result
  };
  struct Copy {
    std::string dir;
    format::Release release;
    std::map<std::pair<uint32_t, uint32_t>, File> files;  // (rank, layer)
    uint64_t reads = 0;
  };
  struct InFlight {
    uint64_t tag = 0;
    const File* file = nullptr;
    uint32_t expert = 0;
    uint32_t copy = 0;
    uint64_t bytes = 0;
    bool sync = false;
    std::chrono::steady_clock::time_point start;
  };
  struct Pending {
    ReadRequest request;
    uint32_t copy = 0;
    File* file = nullptr;
    bool sync = false;
    std::chrono::steady_clock::time_point start;
  };

  RecordStore(RecordStoreOptions options, std::vector<Copy> copies)
      : options_(options), copies_(std::move(copies)) {}
  absl::Status OpenFiles(DirectIo mode);
  absl::Status AllocateBuffers();
  absl::Status VerifyFile(File& file);
  absl::Status Enqueue(const ReadRequest& request, bool sync);
  void Complete(RecordCompletion completion, bool sync);
  absl::Status Pump();  // moves pending reads into the ring while it has room
  absl::Status Reap(const IoCompletion& io);

  RecordStoreOptions options_;
  std::vector<Copy> copies_;
  std::unique_ptr<IoUringReader> ring_;
  std::vector<std::byte*> buffer_memory_;
  std::vector<std::span<std::byte>> buffers_;
  uint64_t max_rec_bytes_ = 0;
  uint32_t next_copy_ = 0;
  uint64_t next_id_ = 0;
  std::deque<Pending> pending_;
  std::unordered_map<uint64_t, InFlight> in_flight_;
  std::deque<RecordCompletion> ready_;
  std::optional<RecordCompletion> sync_done_;
};

}  // namespace nq::streamer
