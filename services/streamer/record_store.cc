#include "services/streamer/record_store.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "spdlog/spdlog.h"

namespace nq::streamer {
namespace {

uint64_t RoundUp(uint64_t n, uint64_t align) { return (n + align - 1) / align * align; }

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kDirectIoAlign == 0; }

}  // namespace

absl::StatusOr<std::unique_ptr<RecordStore>> RecordStore::Open(std::vector<std::string> dirs,
                                                               RecordStoreOptions options) {
  if (dirs.empty()) return absl::InvalidArgumentError("record store: no release directory");
  if (options.queue_depth == 0) {
    return absl::InvalidArgumentError("record store: queue depth must be > 0");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<RecordFiles> files,
                   RecordFiles::Open(std::move(dirs), options.direct_io));
  return Create(std::move(files), options);
}

absl::StatusOr<std::unique_ptr<RecordStore>> RecordStore::Create(
    std::shared_ptr<const RecordFiles> files, RecordStoreOptions options) {
  if (files == nullptr) return absl::InvalidArgumentError("record store: no record files");
  if (options.queue_depth == 0) {
    return absl::InvalidArgumentError("record store: queue depth must be > 0");
  }
  if (options.read_piece_bytes % kDirectIoAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat("record store: read piece of ", options.read_piece_bytes,
                                                   " bytes is not a multiple of ", kDirectIoAlign));
  }
  if (options.queue_depth > kMaxRingEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("record store: queue depth ", options.queue_depth, " exceeds ", kMaxRingEntries));
  }
  std::unique_ptr<RecordStore> store(new RecordStore(options, std::move(files)));
  RETURN_IF_ERROR(store->AllocateBuffers());
  // Pieces per record, bounded so the ring holds every piece of queue_depth records.
  const uint64_t record = RoundUp(std::max<uint64_t>(store->files_->max_rec_bytes(), 1), kDirectIoAlign);
  uint64_t piece = options.read_piece_bytes == 0 ? record : std::min<uint64_t>(options.read_piece_bytes, record);
  // An injected slow read adds one entry per record, its timer.
  const uint64_t timers = options.faults.slow > 0 ? 1 : 0;
  const uint64_t max_pieces = kMaxRingEntries / options.queue_depth - timers;
  if (max_pieces == 0) {
    return absl::InvalidArgumentError(absl::StrCat("record store: queue depth ", options.queue_depth,
                                                   " leaves no ring entry for slow-read timers"));
  }
  if ((record + piece - 1) / piece > max_pieces) piece = RoundUp((record + max_pieces - 1) / max_pieces, kDirectIoAlign);
  store->piece_bytes_ = piece;
  const auto entries = static_cast<unsigned>(options.queue_depth * ((record + piece - 1) / piece + timers));
  ASSIGN_OR_RETURN(store->ring_, IoUringReader::Create(entries, store->buffers_));
  return store;
}

RecordStore::~RecordStore() {
  {
    // The verifier's callbacks use this store (and signal the ring's eventfd): wait for them.
    absl::MutexLock lock(&verify_mu_);
    verify_mu_.Await(absl::Condition(
        +[](size_t* verifying) { return *verifying == 0; }, &verifying_));
  }
  ring_.reset();  // drains reads in flight before their buffers go
  for (std::byte* b : buffer_memory_) std::free(b);
}

absl::Status RecordStore::AllocateBuffers() {
  const uint64_t size = RoundUp(std::max<uint64_t>(files_->max_rec_bytes(), 1), kDirectIoAlign);
  for (unsigned i = 0; i < options_.buffers; ++i) {
    auto* memory = static_cast<std::byte*>(std::aligned_alloc(kDirectIoAlign, size));
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("record store: cannot allocate buffer ", i, " of ", size, " bytes"));
    }
    buffer_memory_.push_back(memory);
    buffers_.emplace_back(memory, size);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RecordStore::RecordBytes(uint32_t rank, uint32_t layer) const {
  return files_->RecordBytes(rank, layer);
}

std::span<std::byte> RecordStore::Buffer(unsigned index) const {
  return index < buffers_.size() ? buffers_[index] : std::span<std::byte>();
}

absl::Status RecordStore::Submit(const ReadRequest& request) { return Enqueue(request, false); }

absl::Status RecordStore::Enqueue(const ReadRequest& request, bool sync) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<const format::LayerEntry*> entry = release().Layer(request.rank, request.layer);
  if (!entry.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("record store: no rank ", request.rank,
                                                   " layer ", request.layer, " in ",
                                                   files_->dir(0)));
  }
  const uint32_t experts = release().manifest().experts_per_layer;
  if (request.expert >= experts) {
    return absl::InvalidArgumentError(absl::StrCat("record store: expert ", request.expert,
                                                   " out of range (", experts, " per layer)"));
  }
  const uint32_t copy = next_copy_ % files_->copies();
  const File& file = *files_->Find(copy, request.rank, request.layer);
  if (request.buffer_index >= 0) {
    if (static_cast<size_t>(request.buffer_index) >= buffers_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("record store: buffer index ",
                                                     request.buffer_index, " of ",
                                                     buffers_.size(), " registered"));
    }
  } else {
    if (request.destination.size() != file.rec_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "record store: destination of ", request.destination.size(),
          " bytes for a record of ", file.rec_bytes));
    }
    if (file.direct && !Aligned(request.destination.data())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "record store: destination not aligned to ", kDirectIoAlign, " for O_DIRECT"));
    }
  }
  ++next_copy_;
  // A store that checks records never hashes whole files: see RecordStoreOptions::verify_hashes.
  if (options_.verify_hashes && !options_.verify_records) {
    absl::Status verified = files_->Verify(file);
    if (!verified.ok()) {
      Complete(RecordCompletion{.tag = request.tag, .status = verified, .failure = "hash", .copy = copy}, sync);
      return absl::OkStatus();
    }
  }
  pending_.push_back(
      Pending{.request = request, .copy = copy, .file = &file, .sync = sync, .start = start});
  return Pump();
}

void RecordStore::Complete(RecordCompletion completion, bool sync) {
  if (sync) {
    sync_done_ = std::move(completion);
  } else {
    ready_.push_back(std::move(completion));
  }
}

absl::Status RecordStore::Pump() {
  while (!pending_.empty() && in_flight_.size() < options_.queue_depth) {
    const Pending p = pending_.front();
    pending_.pop_front();
    const uint64_t id = next_id_++;
    const uint64_t offset = p.file->base_offset + uint64_t{p.request.expert} * p.file->rec_bytes;
    InFlight f{.tag = p.request.tag,
               .file = p.file,
               .expert = p.request.expert,
               .copy = p.copy,
               .bytes = p.file->rec_bytes,
               .sync = p.sync,
               .injected = options_.faults.any() && (!options_.faults.rank.has_value() ||
                                                     *options_.faults.rank == p.request.rank)
                             ? faults_.Next()
                             : ReadFault::kNone};
    if (f.injected == ReadFault::kSlow) {
      f.injected = ReadFault::kNone;
      f.slow = true;
    }
    f.landing = p.request.buffer_index >= 0
                    ? std::span<const std::byte>(buffers_[static_cast<size_t>(p.request.buffer_index)].first(p.file->rec_bytes))
                    : std::span<const std::byte>(p.request.destination);
    // Latency counts from before the first piece goes out: each Submit* enters the kernel at once,
    // so a slow read's timer starts inside this loop, and a stamp taken after it would make the
    // read look shorter than its own delay.
    f.issued = std::chrono::steady_clock::now();
    f.queued_seconds = std::chrono::duration<double>(f.issued - p.start).count();
    // Every piece goes out now: the ring has room for all pieces of queue_depth records.
    for (uint64_t at = 0; at < p.file->rec_bytes; at += piece_bytes_) {
      const auto bytes = static_cast<uint32_t>(std::min<uint64_t>(piece_bytes_, p.file->rec_bytes - at));
      const uint64_t piece = next_id_++;
      const absl::Status submitted =
          p.request.buffer_index >= 0
              ? ring_->SubmitReadFixed(p.file->fd, offset + at, bytes, static_cast<unsigned>(p.request.buffer_index),
                                       piece, at)
              : ring_->SubmitRead(p.file->fd, offset + at, p.request.destination.subspan(at, bytes), piece);
      if (!submitted.ok()) {
        // The pieces already in the ring still land; the record then completes with this error.
        f.status = submitted;
        f.failure = "submit";
        break;
      }
      f.pieces.push_back(piece);
      piece_owner_.emplace(piece, Piece{.record = id, .offset = at, .bytes = bytes});
    }
    if (f.slow && f.status.ok()) {
      // The record lands only when its timer has fired too: a read taking slow_ms or longer.
      const uint64_t timer = next_id_++;
      const absl::Status submitted = ring_->SubmitDelay(std::chrono::milliseconds(options_.faults.slow_ms), timer);
      if (submitted.ok()) {
        f.pieces.push_back(timer);
        piece_owner_.emplace(timer, Piece{.record = id, .timer = true});
      } else {
        f.status = submitted;
        f.failure = "submit";
      }
    }
    if (f.pieces.empty()) {
      Complete(RecordCompletion{.tag = p.request.tag, .status = f.status, .queued_seconds = f.queued_seconds,
                                .copy = p.copy},
               p.sync);
      continue;
    }
    ++reads_issued_;
    f.pieces_left = f.pieces.size();
    in_flight_.emplace(id, std::move(f));
  }
  return absl::OkStatus();
}

absl::Status RecordStore::Reap(const IoCompletion& io) {
  const auto owner = piece_owner_.find(io.user_data);
  if (owner == piece_owner_.end()) {
    return absl::InternalError(absl::StrCat("record store: unknown completion ", io.user_data));
  }
  const Piece piece = owner->second;
  piece_owner_.erase(owner);
  auto it = in_flight_.find(piece.record);
  if (it == in_flight_.end()) {
    return absl::InternalError(absl::StrCat("record store: completion ", io.user_data, " of no record in flight"));
  }
  InFlight& f = it->second;
  if (piece.timer) {
    // A slow read's timer fires with -ETIME (DEADLINE_EXCEEDED), or is cancelled with its record.
    if (!io.status.ok() && io.status.code() != absl::StatusCode::kDeadlineExceeded &&
        io.status.code() != absl::StatusCode::kCancelled && f.status.ok()) {
      f.status = absl::Status(io.status.code(), absl::StrCat("record store: slow-read timer of expert ", f.expert,
                                                             ": ", io.status.message()));
      f.failure = "io_error";
    }
    return --f.pieces_left > 0 ? absl::OkStatus() : FinishRecord(it);
  }
  // An injected fault turns this completion into what a failing drive returns.
  IoCompletion landed = io;
  if (f.injected == ReadFault::kIoError && landed.status.ok()) {
    landed.status = absl::Status(absl::StatusCode::kUnknown, "Input/output error (injected)");
  } else if (f.injected == ReadFault::kShortRead && landed.status.ok()) {
    landed.bytes = piece.bytes / 2;
  }
  f.injected = ReadFault::kNone;
  if (!landed.status.ok()) {
    if (f.status.ok()) {
      f.status = absl::Status(landed.status.code(), absl::StrCat("record store: reading expert ", f.expert, " from ",
                                                                 f.file->path, ": ", landed.status.message()));
      f.failure = "io_error";
    }
  } else if (landed.bytes != piece.bytes && f.status.ok()) {
    f.status = absl::DataLossError(absl::StrCat("record store: short read of expert ", f.expert, " from ",
                                                f.file->path, ": ", piece.offset + landed.bytes, " of ", f.bytes,
                                                " bytes"));
    f.failure = "short_read";
  }
  if (--f.pieces_left > 0) return absl::OkStatus();
  return FinishRecord(it);
}

absl::Status RecordStore::FinishRecord(std::unordered_map<uint64_t, InFlight>::iterator it) {
  InFlight& f = it->second;
  RecordCompletion c;
  c.tag = f.tag;
  c.copy = f.copy;
  c.cancelled = f.cancelled;
  c.queued_seconds = f.queued_seconds;
  c.latency_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - f.issued).count();
  c.status = f.status;
  c.failure = f.failure;
  c.injected_slow = f.slow;
  if (c.status.ok()) {
    c.bytes = f.bytes;
    ++reads_per_copy_[f.copy];
  }
  const bool sync = f.sync;
  const File& file = *f.file;
  const uint32_t expert = f.expert;
  const std::span<const std::byte> landing = f.landing;
  in_flight_.erase(it);
  // Refill the ring first: the check below (inline, without a verifier) then overlaps the next
  // reads instead of leaving the drive idle.
  const absl::Status pumped = Pump();
  CheckAndComplete(std::move(c), file, expert, landing, sync);
  return pumped;
}

void RecordStore::CheckAndComplete(RecordCompletion completion, const File& file, uint32_t expert,
                                   std::span<const std::byte> bytes, bool sync) {
  if (!options_.verify_records || !completion.status.ok()) {
    Complete(std::move(completion), sync);
    return;
  }
  // RecordFiles come from validated indexes (one checksum per expert), and Enqueue checked the
  // expert against the manifest.
  RecordDigest expected =
      format::ExpectedRecordDigest(*file.entry, expert, options_.record_check == RecordCheck::kSha256);
  auto judge = [&file, expert, expected](RecordCompletion& c, bool matches) {
    if (matches) return;
    c.status = absl::DataLossError(absl::StrCat("record store: expert ", expert, " of layer ", file.layer, " (rank ",
                                                file.rank, ") read from ", file.path, " does not match its ",
                                                expected.name(), " in the index (", expected.hex, ")"));
    c.failure = "checksum";
    c.bytes = 0;
  };
  if (sync || options_.verifier == nullptr) {
    judge(completion, RecordMatches(bytes, expected));
    Complete(std::move(completion), sync);
    return;
  }
  {
    absl::MutexLock lock(&verify_mu_);
    ++verifying_;
    verifying_tags_.insert(completion.tag);
  }
  options_.verifier->Submit(bytes, std::move(expected), [this, judge, c = std::move(completion)](bool matches) mutable {
    judge(c, matches);
    // All under the lock: the destructor waits for verifying_ == 0 before the ring (whose
    // eventfd this signals) goes.
    absl::MutexLock lock(&verify_mu_);
    verified_.push_back(std::move(c));
    if (absl::Status s = ring_->SignalCompletion(); !s.ok()) {
      spdlog::warn("record store: signalling a checked record: {}", s.ToString());
    }
    --verifying_;
  });
}

void RecordStore::CollectVerified() {
  absl::MutexLock lock(&verify_mu_);
  for (RecordCompletion& c : verified_) {
    verifying_tags_.erase(verifying_tags_.find(c.tag));
    if (auto cancelled = cancelled_verifying_.find(c.tag); cancelled != cancelled_verifying_.end()) {
      cancelled_verifying_.erase(cancelled);
      c.cancelled = true;
    }
    ready_.push_back(std::move(c));
  }
  verified_.clear();
}

size_t RecordStore::Verifying() const {
  absl::MutexLock lock(&verify_mu_);
  return verifying_tags_.size();
}

size_t RecordStore::outstanding() const {
  return ready_.size() + pending_.size() + in_flight_.size() + Verifying();
}

absl::StatusOr<CancelOutcome> RecordStore::Cancel(uint64_t tag) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->sync || it->request.tag != tag) continue;
    const Pending p = *it;
    pending_.erase(it);
    Complete(RecordCompletion{.tag = tag,
                              .status = absl::CancelledError(absl::StrCat(
                                  "record store: read of expert ", p.request.expert, " from ", p.file->path,
                                  " cancelled before it was issued")),
                              .copy = p.copy,
                              .cancelled = true},
             false);
    return CancelOutcome::kDequeued;
  }
  // In flight: the oldest read with the tag (ids increase with submission).
  auto oldest = in_flight_.end();
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    const InFlight& f = it->second;
    if (f.sync || f.cancelled || f.tag != tag) continue;
    if (oldest == in_flight_.end() || it->first < oldest->first) oldest = it;
  }
  if (oldest != in_flight_.end()) {
    oldest->second.cancelled = true;
    // Each piece still in the ring is asked to stop. If the kernel cannot be asked, the piece
    // lands as usual and the record, still marked cancelled, is discarded by its owner: the
    // outcome is the same as a cancel the kernel declined.
    for (uint64_t piece : oldest->second.pieces) {
      if (!piece_owner_.contains(piece)) continue;  // landed already
      if (absl::Status s = ring_->Cancel(piece); !s.ok()) {
        spdlog::warn("record store: cancel of the read of expert {} from {} not submitted: {}",
                     oldest->second.expert, oldest->second.file->path, s.ToString());
      }
    }
    return CancelOutcome::kInFlight;
  }
  for (RecordCompletion& done : ready_) {
    if (done.tag == tag && !done.cancelled) {
      done.cancelled = true;
      return CancelOutcome::kCompleted;
    }
  }
  {
    // Landed and being checked: nothing to stop; the completion comes marked cancelled.
    absl::MutexLock lock(&verify_mu_);
    if (verifying_tags_.count(tag) > cancelled_verifying_.count(tag)) {
      cancelled_verifying_.insert(tag);
      return CancelOutcome::kCompleted;
    }
  }
  return absl::NotFoundError(absl::StrCat("record store: no read with tag ", tag, " outstanding"));
}

absl::StatusOr<std::vector<RecordCompletion>> RecordStore::Poll() {
  RETURN_IF_ERROR(ring_->ClearCompletionSignal());
  while (true) {
    ASSIGN_OR_RETURN(std::optional<IoCompletion> io, ring_->Poll());
    if (!io.has_value()) break;
    RETURN_IF_ERROR(Reap(*io));
  }
  CollectVerified();
  std::vector<RecordCompletion> done(std::make_move_iterator(ready_.begin()),
                                     std::make_move_iterator(ready_.end()));
  ready_.clear();
  return done;
}

absl::StatusOr<RecordCompletion> RecordStore::Wait() {
  while (ready_.empty()) {
    CollectVerified();
    if (!ready_.empty()) break;
    const bool verifying = Verifying() > 0;
    if (in_flight_.empty() && !verifying) {
      return absl::FailedPreconditionError("record store: no read outstanding");
    }
    if (!verifying) {
      ASSIGN_OR_RETURN(IoCompletion io, ring_->Wait());
      RETURN_IF_ERROR(Reap(io));
      continue;
    }
    // The ring or the verifier may finish first; both signal completion_fd. Clear it before
    // looking, so a completion posted after the look wakes the sleep below.
    RETURN_IF_ERROR(ring_->ClearCompletionSignal());
    while (true) {
      ASSIGN_OR_RETURN(std::optional<IoCompletion> io, ring_->Poll());
      if (!io.has_value()) break;
      RETURN_IF_ERROR(Reap(*io));
    }
    CollectVerified();
    if (!ready_.empty()) break;
    const int fd = ring_->completion_fd();
    RETURN_IF_ERROR(WaitReadable(std::span<const int>(&fd, 1), absl::Seconds(1)).status());
  }
  RecordCompletion c = std::move(ready_.front());
  ready_.pop_front();
  return c;
}

absl::Status RecordStore::ReadRecord(uint32_t rank, uint32_t layer, uint32_t expert,
                                     std::span<std::byte> out) {
  sync_done_.reset();
  RETURN_IF_ERROR(Enqueue(
      ReadRequest{.rank = rank, .layer = layer, .expert = expert, .destination = out}, true));
  while (!sync_done_.has_value()) {
    ASSIGN_OR_RETURN(IoCompletion io, ring_->Wait());
    RETURN_IF_ERROR(Reap(io));
  }
  absl::Status status = std::move(sync_done_->status);
  sync_done_.reset();
  return status;
}

}  // namespace nq::streamer
