#include "services/common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace nq {
namespace {

absl::Status ErrnoError(const char* what, const std::string& name, int err) {
  const std::string message = absl::StrCat(what, "(", name, "): ", std::strerror(err));
  switch (err) {
    case ENOENT: return absl::NotFoundError(message);
    case EEXIST: return absl::AlreadyExistsError(message);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(message);
    case ENOMEM:
    case ENOSPC: return absl::ResourceExhaustedError(message);
    case EINVAL:
    case ENAMETOOLONG: return absl::InvalidArgumentError(message);
    default: return absl::InternalError(message);
  }
}

absl::Status CheckName(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory name '", name, "' must be '/' followed by a name without '/'"));
  }
  return absl::OkStatus();
}

// Closes the descriptor on every path out of Create/Open.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

absl::StatusOr<SharedMemory> SharedMemory::Create(const std::string& name, size_t bytes) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (bytes == 0) return absl::InvalidArgumentError("shared memory of 0 bytes");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoError("shm_open", name, errno);
  FdCloser closer{fd};
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    shm_unlink(name.c_str());
    return ErrnoError("ftruncate", name, err);
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    shm_unlink(name.c_str());
    return ErrnoError("mmap", name, err);
  }
  SharedMemory shm;
  shm.name_ = name;
  shm.data_ = static_cast<uint8_t*>(data);
  shm.size_ = bytes;
  shm.owns_name_ = true;
  return shm;
}

absl::StatusOr<SharedMemory> SharedMemory::Open(const std::string& name, size_t expected_bytes) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("shm_open", name, errno);
  FdCloser closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoError("fstat", name, errno);
  if (static_cast<size_t>(st.st_size) != expected_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("shared memory ", name, " holds ", st.st_size,
                                                      " bytes, expected ", expected_bytes));
  }
  if (expected_bytes == 0) return absl::InvalidArgumentError("shared memory of 0 bytes");
  void* data = mmap(nullptr, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return ErrnoError("mmap", name, errno);
  SharedMemory shm;
  shm.name_ = name;
  shm.data_ = static_cast<uint8_t*>(data);
  shm.size_ = expected_bytes;
  shm.owns_name_ = false;
  return shm;
}

absl::Status SharedMemory::Unlink(const std::string& name) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) return ErrnoError("shm_unlink", name, errno);
  return absl::OkStatus();
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept { *this = std::move(other); }

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owns_name_ = std::exchange(other.owns_name_, false);
  }
  return *this;
}

SharedMemory::~SharedMemory() { Reset(); }

void SharedMemory::Reset() {
  // Errors here cannot be reported (destructors do not fail) and leave nothing to undo.
  if (data_ != nullptr) munmap(data_, size_);
  if (owns_name_) shm_unlink(name_.c_str());
  data_ = nullptr;
  size_ = 0;
  owns_name_ = false;
}

}  // namespace nq
