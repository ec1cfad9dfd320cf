// A thin RAII wrapper over one io_uring used for reads only: a ring of `queue_depth`
// entries, an optional set of registered (fixed) buffers, read submissions tagged with a
// caller `user_data`, and completions turned into absl::Status. An eventfd registered with
// the ring (completion_fd) becomes readable whenever a completion is posted, so an owner
// that also waits for other events can sleep in poll(2) instead of polling the ring. Every
// liburing return is checked. Not thread-safe: one owner thread submits and reaps.
//
// Cancel asks the kernel to stop a read in flight (IORING_OP_ASYNC_CANCEL). Whether it can
// is the kernel's call: an O_DIRECT read already handed to the block device runs to the end,
// so the read's own completion still comes, either -ECANCELED (CANCELLED) or as it landed.
// The cancel request's completion is consumed here and never returned by Poll/Wait.
#pragma once

#include <liburing.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/streamer/event_fd.h"

namespace nq::streamer {

// user_data values with this bit set are the reader's own (cancel requests); reads must not
// use it.
inline constexpr uint64_t kCancelUserDataBit = uint64_t{1} << 63;

struct IoCompletion {
  uint64_t user_data = 0;
  // OK with `bytes` read, or the errno of the read as a status (short reads are the
  // caller's to judge: `bytes` is what the kernel returned).
  absl::Status status;
  uint32_t bytes = 0;
};

class IoUringReader {
 public:
  // INVALID_ARGUMENT for queue_depth 0; the errno of io_uring_queue_init, eventfd,
  // io_uring_register_eventfd or io_uring_register_buffers otherwise. `buffers` (may be empty) are registered as fixed
  // buffers 0..n-1 and must outlive the reader.
  static absl::StatusOr<std::unique_ptr<IoUringReader>> Create(
      unsigned queue_depth, std::span<const std::span<std::byte>> buffers = {});
  ~IoUringReader();
  IoUringReader(const IoUringReader&) = delete;
  IoUringReader& operator=(const IoUringReader&) = delete;

  unsigned queue_depth() const { return queue_depth_; }
  // Reads submitted whose completion has not been consumed (cancel requests not counted).
  unsigned in_flight() const { return in_flight_; }
  size_t registered_buffers() const { return buffers_.size(); }

  // Queues and submits a read of `bytes` at `offset` of `fd` into registered buffer
  // `buffer_index` at `buffer_offset` (IORING_OP_READ_FIXED). RESOURCE_EXHAUSTED when
  // queue_depth reads are already in flight; INVALID_ARGUMENT for a user_data with
  // kCancelUserDataBit set, or a range past the buffer's end.
  absl::Status SubmitReadFixed(int fd, uint64_t offset, uint32_t bytes, unsigned buffer_index,
                               uint64_t user_data, uint64_t buffer_offset = 0);
  // The same into any memory (IORING_OP_READ).
  absl::Status SubmitRead(int fd, uint64_t offset, std::span<std::byte> destination,
                          uint64_t user_data);
  // Queues a timer that completes after `delay` (IORING_OP_TIMEOUT), counted as a read in
  // flight: the record store's injected slow reads hold a record until it fires. It completes
  // with DEADLINE_EXCEEDED when it fires (the kernel's -ETIME), CANCELLED when cancelled.
  absl::Status SubmitDelay(std::chrono::milliseconds delay, uint64_t user_data);
  // Asks the kernel to cancel the read submitted with `user_data` (still in flight: its
  // completion not yet consumed). The read's completion comes either way; see the top of this
  // file. FAILED_PRECONDITION when no read is in flight; RESOURCE_EXHAUSTED when queue_depth
  // cancel requests are already pending; the errno of io_uring_submit.
  absl::Status Cancel(uint64_t user_data);

  // What the kernel answered the cancel requests consumed so far (ASYNC_CANCEL's result):
  // stopped the read (0), found it already running (-EALREADY), or no longer found it
  // (-ENOENT: it had completed). Any other answer is logged and counted in `failed`.
  struct CancelResults {
    uint64_t stopped = 0;
    uint64_t running = 0;
    uint64_t not_found = 0;
    uint64_t failed = 0;
  };
  const CancelResults& cancel_results() const { return cancel_results_; }
  // Readable once a completion has been posted since the last ClearCompletionSignal.
  int completion_fd() const { return completion_signal_->fd(); }
  // Call before draining with Poll: a completion posted after it makes the fd readable
  // again, so no completion is left behind unsignalled.
  absl::Status ClearCompletionSignal() { return completion_signal_->Clear(); }
  // Makes completion_fd readable as a posted completion would, from any thread: the record
  // store's verifier says a record's check is done this way, so its owner wakes once for both.
  absl::Status SignalCompletion() const { return completion_signal_->Signal(); }

  // A completion if one is ready, without blocking.
  absl::StatusOr<std::optional<IoCompletion>> Poll();
  // Blocks for the next completion; FAILED_PRECONDITION when nothing is in flight.
  absl::StatusOr<IoCompletion> Wait();

 private:
  explicit IoUringReader(unsigned queue_depth) : queue_depth_(queue_depth) {}
  absl::StatusOr<io_uring_sqe*> NextSqe();
  absl::Status Submit();
  // Consumes `cqe`: a read's completion, or nullopt for a cancel request's (tallied).
  std::optional<IoCompletion> Consume(io_uring_cqe* cqe);

  unsigned queue_depth_;
  unsigned in_flight_ = 0;
  // Pending cancel requests: at most queue_depth, so with at most queue_depth reads they never
  // overrun the completion ring (twice the submission ring's entries).
  unsigned cancels_in_flight_ = 0;
  CancelResults cancel_results_;
  bool ring_ready_ = false;
  io_uring ring_{};
  std::optional<EventFd> completion_signal_;
  std::vector<std::span<std::byte>> buffers_;
};

}  // namespace nq::streamer
