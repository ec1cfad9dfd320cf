#include "services/streamer/event_fd.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace nq::streamer {
namespace {

absl::Status ErrnoStatus(int err, const char* what) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, ": ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<EventFd> EventFd::Create() {
  const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "eventfd");
  return EventFd(fd);
}

EventFd::EventFd(EventFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

EventFd& EventFd::operator=(EventFd&& other) noexcept {
  if (this != &other) {
    this->~EventFd();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

EventFd::~EventFd() {
  if (fd_ >= 0 && ::close(fd_) != 0) spdlog::warn("eventfd close: {}", std::strerror(errno));
  fd_ = -1;
}

absl::Status EventFd::Signal() const {
  const uint64_t one = 1;
  while (true) {
    const ssize_t n = ::write(fd_, &one, sizeof(one));
    if (n == static_cast<ssize_t>(sizeof(one))) return absl::OkStatus();
    if (n < 0 && errno == EINTR) continue;
    // EAGAIN: the counter is at its maximum, so the fd is readable already.
    if (n < 0 && errno == EAGAIN) return absl::OkStatus();
    return n < 0 ? ErrnoStatus(errno, "eventfd write")
                 : absl::InternalError(absl::StrCat("eventfd write of ", n, " bytes"));
  }
}

absl::Status EventFd::Clear() const {
  uint64_t count = 0;
  while (true) {
    const ssize_t n = ::read(fd_, &count, sizeof(count));
    if (n == static_cast<ssize_t>(sizeof(count))) return absl::OkStatus();
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return absl::OkStatus();  // nothing signalled
    return n < 0 ? ErrnoStatus(errno, "eventfd read")
                 : absl::InternalError(absl::StrCat("eventfd read of ", n, " bytes"));
  }
}

absl::StatusOr<std::vector<bool>> WaitReadable(std::span<const int> fds, absl::Duration timeout) {
  std::vector<pollfd> polled;
  polled.reserve(fds.size());
  for (int fd : fds) polled.push_back(pollfd{.fd = fd, .events = POLLIN, .revents = 0});
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const int64_t left_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    const int rc = ::poll(polled.data(), polled.size(), static_cast<int>(std::min<int64_t>(left_ms, 1 << 30)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) return ErrnoStatus(errno, "poll");
    std::vector<bool> readable;
    readable.reserve(polled.size());
    for (const pollfd& p : polled) {
      if ((p.revents & (POLLERR | POLLNVAL)) != 0) {
        return absl::InternalError(absl::StrCat("poll: fd ", p.fd, " reports an error (revents ", p.revents, ")"));
      }
      readable.push_back((p.revents & POLLIN) != 0);
    }
    return readable;
  }
}

}  // namespace nq::streamer
