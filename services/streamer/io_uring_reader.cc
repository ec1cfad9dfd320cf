#include "services/streamer/io_uring_reader.h"

#include <cerrno>
#include <cstring>
#include <string>

#include <sys/uio.h>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace nq::streamer {
namespace {

absl::Status ErrnoStatus(int err, const std::string& what) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, ": ", std::strerror(err)));
}

absl::Status CheckReadUserData(uint64_t user_data) {
  if ((user_data & kCancelUserDataBit) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("io_uring: read user_data ", user_data, " has the reserved cancel bit set"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<IoUringReader>> IoUringReader::Create(
    unsigned queue_depth, std::span<const std::span<std::byte>> buffers) {
  if (queue_depth == 0) return absl::InvalidArgumentError("io_uring queue depth must be > 0");
  std::unique_ptr<IoUringReader> reader(new IoUringReader(queue_depth));
  int rc = io_uring_queue_init(queue_depth, &reader->ring_, 0);
  if (rc < 0) return ErrnoStatus(-rc, "io_uring_queue_init");
  reader->ring_ready_ = true;
  absl::StatusOr<EventFd> signal = EventFd::Create();
  if (!signal.ok()) return signal.status();
  reader->completion_signal_.emplace(*std::move(signal));
  rc = io_uring_register_eventfd(&reader->ring_, reader->completion_signal_->fd());
  if (rc < 0) return ErrnoStatus(-rc, "io_uring_register_eventfd");
  if (!buffers.empty()) {
    std::vector<iovec> iovecs;
    iovecs.reserve(buffers.size());
    for (std::span<std::byte> b : buffers) iovecs.push_back({b.data(), b.size()});
    rc = io_uring_register_buffers(&reader->ring_, iovecs.data(),
                                   static_cast<unsigned>(iovecs.size()));
    if (rc < 0) return ErrnoStatus(-rc, "io_uring_register_buffers");
    reader->buffers_.assign(buffers.begin(), buffers.end());
  }
  return reader;
}

IoUringReader::~IoUringReader() {
  if (!ring_ready_) return;
  // Drain what is in flight so the kernel never writes into freed memory.
  while (in_flight_ + cancels_in_flight_ > 0) {
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe(&ring_, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      spdlog::error("io_uring_wait_cqe while draining {} reads and {} cancels: {}", in_flight_,
                    cancels_in_flight_, std::strerror(-rc));
      break;
    }
    (void)Consume(cqe);
  }
  // Unregistering is implied by io_uring_queue_exit; a failure here is only worth a log.
  if (!buffers_.empty()) {
    if (int rc = io_uring_unregister_buffers(&ring_); rc < 0) {
      spdlog::warn("io_uring_unregister_buffers: {}", std::strerror(-rc));
    }
  }
  if (completion_signal_.has_value()) {
    if (int rc = io_uring_unregister_eventfd(&ring_); rc < 0 && rc != -ENXIO) {
      spdlog::warn("io_uring_unregister_eventfd: {}", std::strerror(-rc));
    }
  }
  io_uring_queue_exit(&ring_);
}

absl::StatusOr<io_uring_sqe*> IoUringReader::NextSqe() {
  if (in_flight_ >= queue_depth_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("io_uring: ", in_flight_, " reads in flight at queue depth ", queue_depth_));
  }
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) return absl::ResourceExhaustedError("io_uring: submission queue full");
  return sqe;
}

absl::Status IoUringReader::Submit() {
  int rc = io_uring_submit(&ring_);
  if (rc < 0) return ErrnoStatus(-rc, "io_uring_submit");
  if (rc != 1) return absl::InternalError(absl::StrCat("io_uring_submit submitted ", rc, " of 1"));
  ++in_flight_;
  return absl::OkStatus();
}

absl::Status IoUringReader::SubmitReadFixed(int fd, uint64_t offset, uint32_t bytes,
                                            unsigned buffer_index, uint64_t user_data,
                                            uint64_t buffer_offset) {
  if (absl::Status s = CheckReadUserData(user_data); !s.ok()) return s;
  if (buffer_index >= buffers_.size() || buffer_offset > buffers_[buffer_index].size() ||
      bytes > buffers_[buffer_index].size() - buffer_offset) {
    return absl::InvalidArgumentError(absl::StrCat("io_uring: fixed buffer ", buffer_index,
                                                   " of ", buffers_.size(), " cannot take ",
                                                   bytes, " bytes at ", buffer_offset));
  }
  auto sqe = NextSqe();
  if (!sqe.ok()) return sqe.status();
  io_uring_prep_read_fixed(*sqe, fd, buffers_[buffer_index].data() + buffer_offset, bytes, offset,
                           static_cast<int>(buffer_index));
  io_uring_sqe_set_data64(*sqe, user_data);
  return Submit();
}

absl::Status IoUringReader::SubmitRead(int fd, uint64_t offset, std::span<std::byte> destination,
                                       uint64_t user_data) {
  if (absl::Status s = CheckReadUserData(user_data); !s.ok()) return s;
  auto sqe = NextSqe();
  if (!sqe.ok()) return sqe.status();
  io_uring_prep_read(*sqe, fd, destination.data(), static_cast<unsigned>(destination.size()),
                     offset);
  io_uring_sqe_set_data64(*sqe, user_data);
  return Submit();
}

absl::Status IoUringReader::SubmitDelay(std::chrono::milliseconds delay, uint64_t user_data) {
  if (absl::Status s = CheckReadUserData(user_data); !s.ok()) return s;
  auto sqe = NextSqe();
  if (!sqe.ok()) return sqe.status();
  // The kernel copies the timespec while the submission below is prepared, so a local will do.
  __kernel_timespec ts{.tv_sec = delay.count() / 1000, .tv_nsec = (delay.count() % 1000) * 1000000};
  io_uring_prep_timeout(*sqe, &ts, 0, 0);
  io_uring_sqe_set_data64(*sqe, user_data);
  return Submit();
}

absl::Status IoUringReader::Cancel(uint64_t user_data) {
  if (absl::Status s = CheckReadUserData(user_data); !s.ok()) return s;
  if (in_flight_ == 0) return absl::FailedPreconditionError("io_uring: no read in flight to cancel");
  if (cancels_in_flight_ >= queue_depth_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("io_uring: ", cancels_in_flight_, " cancel requests pending at queue depth ", queue_depth_));
  }
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) return absl::ResourceExhaustedError("io_uring: submission queue full");
  io_uring_prep_cancel64(sqe, user_data, 0);
  io_uring_sqe_set_data64(sqe, user_data | kCancelUserDataBit);
  int rc = io_uring_submit(&ring_);
  if (rc < 0) return ErrnoStatus(-rc, "io_uring_submit (cancel)");
  if (rc != 1) return absl::InternalError(absl::StrCat("io_uring_submit submitted ", rc, " of 1 (cancel)"));
  ++cancels_in_flight_;
  return absl::OkStatus();
}

std::optional<IoCompletion> IoUringReader::Consume(io_uring_cqe* cqe) {
  const uint64_t user_data = io_uring_cqe_get_data64(cqe);
  const int res = cqe->res;
  io_uring_cqe_seen(&ring_, cqe);
  if ((user_data & kCancelUserDataBit) != 0) {
    --cancels_in_flight_;
    if (res == 0) {
      ++cancel_results_.stopped;
    } else if (res == -EALREADY) {
      ++cancel_results_.running;
    } else if (res == -ENOENT) {
      ++cancel_results_.not_found;
    } else {
      ++cancel_results_.failed;
      spdlog::warn("io_uring: cancelling read {}: {}", user_data & ~kCancelUserDataBit,
                   std::strerror(res < 0 ? -res : res));
    }
    return std::nullopt;
  }
  IoCompletion c;
  c.user_data = user_data;
  if (res < 0) {
    c.status = ErrnoStatus(-res, "io_uring read");
  } else {
    c.bytes = static_cast<uint32_t>(res);
  }
  --in_flight_;
  return c;
}

absl::StatusOr<std::optional<IoCompletion>> IoUringReader::Poll() {
  while (in_flight_ + cancels_in_flight_ > 0) {
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_peek_cqe(&ring_, &cqe);
    if (rc == -EAGAIN) break;
    if (rc < 0) return ErrnoStatus(-rc, "io_uring_peek_cqe");
    if (std::optional<IoCompletion> read = Consume(cqe)) return read;
  }
  return std::optional<IoCompletion>();
}

absl::StatusOr<IoCompletion> IoUringReader::Wait() {
  while (true) {
    if (in_flight_ == 0) return absl::FailedPreconditionError("io_uring: nothing in flight");
    io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) return ErrnoStatus(-rc, "io_uring_wait_cqe");
    if (std::optional<IoCompletion> read = Consume(cqe)) return *read;
  }
}

}  // namespace nq::streamer
