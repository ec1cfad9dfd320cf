// SafetensorsFile: the read-only memory map of one .safetensors file.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_json.h"

namespace nq::model {
namespace {

static_assert(sizeof(size_t) == 8, "mapping multi-GB shards needs a 64-bit address space");

absl::Status ErrnoError(const char* what, const std::string& path, int err) {
  const std::string message = absl::StrCat(what, "(", path, "): ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR: return absl::NotFoundError(message);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(message);
    case ENOMEM:
    case EMFILE:
    case ENFILE: return absl::ResourceExhaustedError(message);
    default: return absl::InternalError(message);
  }
}

// Closes the descriptor on every path out of Open; the mapping outlives it.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

uint64_t TensorView::numel() const {
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(dim);
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO by mistake must fail below, not wait for a writer. It has
  // no effect on regular files.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoError("open", path, errno);
  FdCloser closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoError("fstat", path, errno);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors file ", path,
                                                   ": not a regular file"));
  }
  SafetensorsFile file;
  file.path_ = path;
  file.size_ = static_cast<uint64_t>(st.st_size);
  const std::string context = absl::StrCat("safetensors file ", path);
  if (file.size_ < kHeaderLengthBytes) {
    // Too short to map usefully (mmap refuses 0 bytes); the parser words the error.
    return Annotate(ParseSafetensorsHeader("", file.size_).status(), context);
  }
  void* base = mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (base == MAP_FAILED) return ErrnoError("mmap", path, errno);
  file.base_ = static_cast<const std::byte*>(base);
  // Weights have no place in a core dump: a crash must not write hundreds of GB.
  if (madvise(base, file.size_, MADV_DONTDUMP) != 0) return ErrnoError("madvise", path, errno);

  absl::StatusOr<Header> header = ParseSafetensorsHeader(
      absl::string_view(reinterpret_cast<const char*>(file.base_), file.size_), file.size_);
  if (!header.ok()) return Annotate(header.status(), context);
  file.header_ = *std::move(header);
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Reset();
    path_ = std::move(other.path_);
    header_ = std::move(other.header_);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Reset(); }

void SafetensorsFile::Reset() {
  // munmap of a mapping we own cannot fail in a way we could act on; destructors don't fail.
  if (base_ != nullptr) munmap(const_cast<std::byte*>(base_), size_);
  base_ = nullptr;
  size_ = 0;
}

std::vector<std::string> SafetensorsFile::Names() const {
  std::vector<std::string> names;
  names.reserve(header_.tensors.size());
  for (const TensorInfo& t : header_.tensors) names.push_back(t.name);
  return names;
}

absl::StatusOr<TensorView> SafetensorsFile::Find(absl::string_view name) const {
  const TensorInfo* info = header_.Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor ", QuoteForMessage(name),
                                            " not found in safetensors file ", path_));
  }
  return View(*info);
}

TensorView SafetensorsFile::View(const TensorInfo& info) const {
  TensorView view;
  view.name = info.name;
  view.dtype = info.dtype;
  view.shape = info.shape;
  view.data = std::span<const std::byte>(base_ + header_.data_offset + info.begin,
                                         info.byte_size());
  return view;
}

absl::Status SafetensorsFile::Prefetch(const TensorView& view) const {
  if (view.data.empty()) return absl::OkStatus();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(view.data.data());
  const uintptr_t base = reinterpret_cast<uintptr_t>(base_);
  if (begin < base || begin + view.data.size() > base + size_) {
    return absl::InvalidArgumentError(absl::StrCat("Prefetch: tensor ", QuoteForMessage(view.name),
                                                   " is not a view of ", path_));
  }
  const uintptr_t aligned = begin & ~(page - 1);  // madvise wants a page-aligned start
  if (madvise(reinterpret_cast<void*>(aligned), begin + view.data.size() - aligned,
              MADV_WILLNEED) != 0) {
    return ErrnoError("madvise", path_, errno);
  }
  return absl::OkStatus();
}

}  // namespace nq::model
