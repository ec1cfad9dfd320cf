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
// The files themselves (validation, open descriptors, O_DIRECT fallback, the per-file sha256,
// hashed at most once) are a RecordFiles, which several stores may share: the streamer opens
// one per process and gives each worker session a RecordStore of its own over it.
//
// Every record is checked on its own (issue #22): the rank index holds each record's SHA-256
// (and XXH3-128, checked by default, where the release has it), and a read completes OK only
// once the bytes that landed match it; one that does not completes with DATA_LOSS (failure
// "checksum") and is never handed out, and only that record is lost. The hashing runs on a
// RecordVerifier's threads when one is given, so the owner thread goes on issuing reads
// meanwhile; without one, on the owner thread after the ring has been refilled. A store that
// does not check records (verify_records = false, verify_hashes on) hashes each whole layer
// file instead, once per RecordFiles, before the first read of it completes; a file that fails
// makes every read of it complete with DATA_LOSS naming the file (failure "hash"). So a bad
// record is never handed out either way.
//
// A read no longer wanted can be cancelled (Cancel): one still queued in the store never
// reaches the disk; one in flight is handed to IORING_OP_ASYNC_CANCEL, which cannot stop an
// O_DIRECT read the device already has, so its completion may still bring the bytes. Either
// way every submitted read has exactly one completion, marked `cancelled`.
//
// A store is not thread-safe: one owner thread submits and reaps. completion_fd() lets that
// thread sleep in poll(2) until a read lands, alongside its other wake-ups.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "services/format/release_reader.h"
#include "services/streamer/io_uring_reader.h"
#include "services/streamer/read_faults.h"
#include "services/streamer/record_files.h"
#include "services/streamer/record_verifier.h"

namespace nq::streamer {

// Largest number of ring entries a store asks for (io_uring's own limit is 32768).
inline constexpr unsigned kMaxRingEntries = 4096;

struct RecordStoreOptions {
  unsigned queue_depth = 8;  // records in flight at once; more are queued in the store
  // Each record is read as pieces of at most this many bytes (a multiple of kDirectIoAlign), all
  // in flight together: drives reach their peak with 128-256 KiB reads many deep, and whole
  // 1-9 MiB records read 8 deep reached 0.72 of it (bench/README.md). 0 reads each record in one
  // read. With queue_depth records of P pieces the ring holds queue_depth x P entries, at most
  // kMaxRingEntries (larger pieces are used where it would hold more).
  uint32_t read_piece_bytes = 256 << 10;
  // Registered (fixed) aligned buffers the store owns, each as large as the largest
  // record; ReadRequest::buffer_index picks one.
  unsigned buffers = 0;
  // How Open opens the files (Create takes them as they are).
  DirectIo direct_io = DirectIo::kAuto;
  // Hash a whole layer file (SHA-256, once per RecordFiles) before its first read may complete
  // OK; a file that fails fails every read of it. Only when verify_records is off: record checks
  // make it redundant, since the hashed range of a layer file is exactly its records (experts x
  // rec_bytes, checked when the index is read) and every byte a read hands out is checked
  // against its record's checksum (a damaged checksum in the index fails its record; it cannot
  // pass damaged bytes). And it is costly: a GLM-5 layer file is about 2.4 GB, about 1.4 s of
  // SHA-256 on the loader thread at the layer's first read (about 100 s over 75 layers at
  // start-up, experts at 2 bits meanwhile), and one bad byte fails every expert of the layer
  // where a record check loses only the damaged record. VerifyLayer still hashes on demand.
  bool verify_hashes = true;
  // Check every record against its checksum in the rank index before its read completes OK,
  // with the checksum `record_check` picks.
  bool verify_records = true;
  RecordCheck record_check = RecordCheck::kFastest;
  // Where records are checked: a shared pool (the streamer's, so hashing overlaps the next
  // reads), or, when null, the owner thread. Synchronous ReadRecord always checks inline.
  std::shared_ptr<RecordVerifier> verifier;
  // Disk faults to inject into the reads (read_faults.h); none by default.
  ReadFaults faults;
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
  // DATA_LOSS for a record that fails its own checksum, a layer file that fails its hash (a
  // store that hashes files: see verify_hashes), or a short read; CANCELLED for a read cancelled
  // before it landed. OK means the whole record landed and matches its checksum in the index
  // (verify_records) or lies in a file whose hash matched (verify_hashes alone).
  absl::Status status;
  // Why a read failed, for the metrics: "io_error", "short_read", "hash", "checksum", "submit"
  // ("" if OK).
  std::string failure;
  // An injected slow read (read_faults.h), for the metrics.
  bool injected_slow = false;
  // Issue to landing: from the read's submission to the ring to its completion being reaped
  // (0 for a read that never reached the ring).
  double latency_seconds = 0;
  // Submit to the read's submission to the ring: time spent queued behind the queue depth.
  double queued_seconds = 0;
  uint64_t bytes = 0;
  uint32_t copy = 0;  // which directory served it
  bool cancelled = false;  // Cancel was called for this read (whatever its status)
};

// Where Cancel found the read.
enum class CancelOutcome {
  kDequeued,   // still queued in the store: it never reaches the disk (completion: CANCELLED)
  kInFlight,   // in the ring: the kernel was asked to stop it; it may land all the same
  kCompleted,  // already completed, not yet returned by Poll/Wait: nothing to stop
};

class RecordStore {
 public:
  // A store over files of its own: RecordFiles::Open(dirs, options.direct_io), then Create.
  // INVALID_ARGUMENT for no directory, a zero queue depth; RecordFiles::Open's errors.
  static absl::StatusOr<std::unique_ptr<RecordStore>> Open(std::vector<std::string> dirs,
                                                           RecordStoreOptions options = {});
  // A store with its own ring and buffers over shared `files`. INVALID_ARGUMENT for a null
  // `files` or a zero queue depth; RESOURCE_EXHAUSTED when a buffer cannot be allocated; the
  // io_uring setup errors.
  static absl::StatusOr<std::unique_ptr<RecordStore>> Create(std::shared_ptr<const RecordFiles> files,
                                                             RecordStoreOptions options = {});
  ~RecordStore();
  RecordStore(const RecordStore&) = delete;
  RecordStore& operator=(const RecordStore&) = delete;

  const RecordFiles& files() const { return *files_; }
  const format::Release& release() const { return files_->release(); }
  size_t copies() const { return files_->copies(); }
  // Records each copy has served through this store so far.
  std::vector<uint64_t> reads_per_copy() const { return reads_per_copy_; }
  // Files read with O_DIRECT / buffered (after fallback or DirectIo::kOff).
  size_t direct_files() const { return files_->direct_files(); }
  size_t buffered_files() const { return files_->buffered_files(); }
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
  size_t outstanding() const;
  // Bytes of each read the ring gets (a record is read in pieces of this size, the last shorter).
  uint64_t piece_bytes() const { return piece_bytes_; }
  // Cancels the oldest outstanding read submitted with `tag` (see the top of this file); its
  // completion still comes through Poll/Wait, marked `cancelled` (a dequeued read's at once,
  // like a hash failure's: completion_fd is not signalled for it). NOT_FOUND when no read with
  // that tag is outstanding.
  absl::StatusOr<CancelOutcome> Cancel(uint64_t tag);
  // Reads handed to the ring so far: the records this store has asked the disk for.
  uint64_t reads_issued() const { return reads_issued_; }
  // The kernel's answers to the cancellations of reads in flight.
  const IoUringReader::CancelResults& cancel_results() const { return ring_->cancel_results(); }
  // Readable once a read has landed since the last Poll (see IoUringReader::completion_fd).
  // Completions of reads that never reach the ring (a file that fails its hash) are ready
  // at once: Poll right after Submit finds them.
  int completion_fd() const { return ring_->completion_fd(); }

  // Synchronous read of one record into `out` (rec_bytes, aligned as for Submit); other
  // completions reaped meanwhile stay queued for Poll/Wait.
  absl::Status ReadRecord(uint32_t rank, uint32_t layer, uint32_t expert,
                          std::span<std::byte> out);

  // Hashes every copy's file of the layer (once per RecordFiles; cached), whatever the options:
  // a store that checks records never does so by itself. DATA_LOSS naming the file on a mismatch.
  absl::Status VerifyLayer(uint32_t rank, uint32_t layer) { return files_->VerifyLayer(rank, layer); }
  // True once every copy's file of the layer has been hashed and matched.
  bool LayerVerified(uint32_t rank, uint32_t layer) const { return files_->LayerVerified(rank, layer); }

 private:
  using File = RecordFiles::File;
  // A record being read: its pieces in the ring (ids in `pieces`, keyed in piece_owner_).
  struct InFlight {
    uint64_t tag = 0;
    const File* file = nullptr;
    uint32_t expert = 0;
    uint32_t copy = 0;
    uint64_t bytes = 0;
    bool sync = false;
    bool cancelled = false;
    double queued_seconds = 0;
    std::chrono::steady_clock::time_point issued;  // submitted to the ring
    std::vector<uint64_t> pieces;
    size_t pieces_left = 0;
    absl::Status status;  // the first piece's failure (or a piece that could not be submitted)
    std::string failure;  // RecordCompletion::failure
    ReadFault injected = ReadFault::kNone;  // EIO / short: applied to the first piece reaped
    bool slow = false;                      // an injected slow read: a timer rides with the pieces
    std::span<const std::byte> landing;     // where the record's bytes land (checked when whole)
  };
  struct Piece {
    uint64_t record = 0;  // key of in_flight_
    uint64_t offset = 0;  // within the record
    uint32_t bytes = 0;
    bool timer = false;   // the delay of an injected slow read, not a read
  };
  struct Pending {
    ReadRequest request;
    uint32_t copy = 0;
    const File* file = nullptr;
    bool sync = false;
    std::chrono::steady_clock::time_point start;
  };

  RecordStore(RecordStoreOptions options, std::shared_ptr<const RecordFiles> files)
      : options_(options), faults_(options.faults), files_(std::move(files)), reads_per_copy_(files_->copies(), 0) {}
  absl::Status AllocateBuffers();
  absl::Status Enqueue(const ReadRequest& request, bool sync);
  void Complete(RecordCompletion completion, bool sync);
  absl::Status Pump();  // moves pending reads into the ring while it has room
  absl::Status Reap(const IoCompletion& io);
  // Every piece of the record `it` has come back: completes it and refills the ring.
  absl::Status FinishRecord(std::unordered_map<uint64_t, InFlight>::iterator it);
  // A record landed whole: checks it against its sha256 (inline, or on the verifier) and
  // completes it.
  void CheckAndComplete(RecordCompletion completion, const File& file, uint32_t expert,
                        std::span<const std::byte> bytes, bool sync);
  // Moves the verifier's finished checks into ready_.
  void CollectVerified();
  // Records with the verifier now.
  size_t Verifying() const;

  RecordStoreOptions options_;
  ReadFaultInjector faults_;
  const std::shared_ptr<const RecordFiles> files_;
  std::vector<uint64_t> reads_per_copy_;
  std::unique_ptr<IoUringReader> ring_;
  uint64_t reads_issued_ = 0;
  std::vector<std::byte*> buffer_memory_;
  std::vector<std::span<std::byte>> buffers_;
  uint32_t next_copy_ = 0;
  uint64_t next_id_ = 0;
  uint64_t piece_bytes_ = 0;  // the piece size in use (see RecordStoreOptions::read_piece_bytes)
  std::deque<Pending> pending_;
  std::unordered_map<uint64_t, InFlight> in_flight_;
  std::unordered_map<uint64_t, Piece> piece_owner_;  // ring user_data -> its record
  std::deque<RecordCompletion> ready_;
  std::optional<RecordCompletion> sync_done_;

  // The verifier's threads hand checked records back here (then signal completion_fd).
  mutable absl::Mutex verify_mu_;
  std::deque<RecordCompletion> verified_ ABSL_GUARDED_BY(verify_mu_);
  size_t verifying_ ABSL_GUARDED_BY(verify_mu_) = 0;
  // Tags cancelled while their record was being checked: marked `cancelled` when collected.
  std::multiset<uint64_t> cancelled_verifying_ ABSL_GUARDED_BY(verify_mu_);
  std::multiset<uint64_t> verifying_tags_ ABSL_GUARDED_BY(verify_mu_);
};

}  // namespace nq::streamer
