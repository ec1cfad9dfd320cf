// An eventfd (eventfd(2)) as an RAII wake-up signal between threads, or from the kernel:
// registered with an io_uring it becomes readable when a completion is posted. Non-blocking
// and close-on-exec; every syscall result becomes a Status.
#pragma once

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace nq::streamer {

class EventFd {
 public:
  // The errno of eventfd(2).
  static absl::StatusOr<EventFd> Create();
  EventFd(EventFd&& other) noexcept;
  EventFd& operator=(EventFd&& other) noexcept;
  ~EventFd();
  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;

  int fd() const { return fd_; }
  // Makes the fd readable (adds 1 to its counter). Safe from any thread.
  absl::Status Signal() const;
  // Resets the counter; OK when nothing was signalled.
  absl::Status Clear() const;

 private:
  explicit EventFd(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// Blocks until one of `fds` is readable or `timeout` passes (retrying on EINTR); the result
// says, per fd, whether it is readable (all false on timeout). The errno of poll(2)
// otherwise.
absl::StatusOr<std::vector<bool>> WaitReadable(std::span<const int> fds, absl::Duration timeout);

}  // namespace nq::streamer
