#include "services/format/file_io.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::format {
namespace {

namespace fs = std::filesystem;

// Hashing and copying read in chunks of this size (large enough to stream at NVMe speed).
constexpr size_t kChunkBytes = 4 << 20;

absl::Status ErrnoError(const char* what, const std::string& path, int err) {
  std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

std::string ParentDir(const std::string& path) {
  fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

absl::Status FSyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("opening directory", dir, errno);
  Fd owned(fd);
  return FSync(owned.get(), dir);
}

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};

// Incremental SHA-256 over OpenSSL's EVP interface. EVP fails only when the crypto library
// itself is broken (never on input), an impossible state: abort, as a CHECK would.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {
    if (ctx_ == nullptr || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) {
      std::abort();
    }
  }
  void Update(std::span<const std::byte> data) {
    if (EVP_DigestUpdate(ctx_.get(), data.data(), data.size()) != 1) std::abort();
  }
  std::string HexDigest() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    if (EVP_DigestFinal_ex(ctx_.get(), digest, &length) != 1) std::abort();
    static constexpr char kHex[] = "0123456789abcdef";
    std::string hex;
    hex.reserve(2 * length);
    for (unsigned int i = 0; i < length; ++i) {
      hex.push_back(kHex[digest[i] >> 4]);
      hex.push_back(kHex[digest[i] & 0xf]);
    }
    return hex;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx_;
};

}  // namespace

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.Release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

int Fd::Release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

absl::StatusOr<Fd> OpenForRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("opening", path, errno);
  return Fd(fd);
}

absl::StatusOr<Fd> OpenForWrite(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("opening for write", path, errno);
  return Fd(fd);
}

absl::Status PReadAll(int fd, uint64_t offset, std::span<std::byte> out, const std::string& path) {
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n =
        ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("reading", path, errno);
    }
    if (n == 0) {
      return absl::OutOfRangeError(
          absl::StrCat(path, " ends at byte ", offset + done, ", before ", offset + out.size()));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PWriteAll(int fd, uint64_t offset, std::span<const std::byte> data,
                       const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n =
        ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("writing", path, errno);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FSync(int fd, const std::string& path) {
  if (::fsync(fd) != 0) return ErrnoError("fsync of", path, errno);
  return absl::OkStatus();
}

absl::Status Truncate(int fd, uint64_t size, const std::string& path) {
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return ErrnoError("truncating", path, errno);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoError("stat of", path, errno);
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(path + " is not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(path));
  ASSIGN_OR_RETURN(Fd fd, OpenForRead(path));
  std::string text(size, '\0');
  RETURN_IF_ERROR(PReadAll(fd.get(), 0, std::as_writable_bytes(std::span<char>(text)), path));
  return text;
}

absl::Status MakeDirs(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("creating directory ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status RemoveFile(const std::string& path) {
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoError("removing", path, errno);
  }
  return FSyncDir(ParentDir(path));
}

absl::Status WriteFileAtomic(const std::string& path, std::span<const std::byte> data) {
  const std::string tmp = path + ".tmp";
  {
    int raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (raw < 0) return ErrnoError("creating", tmp, errno);
    Fd fd(raw);
    RETURN_IF_ERROR(PWriteAll(fd.get(), 0, data, tmp));
    RETURN_IF_ERROR(FSync(fd.get(), tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) return ErrnoError("renaming over", path, errno);
  return FSyncDir(ParentDir(path));
}

absl::Status WriteFileAtomic(const std::string& path, const std::string& text) {
  return WriteFileAtomic(path, AsBytes(text));
}

absl::StatusOr<std::string> CopyRange(const std::string& src_path, uint64_t src_offset,
                                      uint64_t bytes, int dst_fd, uint64_t dst_offset,
                                      const std::string& dst_path) {
  ASSIGN_OR_RETURN(Fd src, OpenForRead(src_path));
  Sha256 sha;
  std::vector<std::byte> chunk(std::min<uint64_t>(bytes, kChunkBytes));
  uint64_t done = 0;
  while (done < bytes) {
    std::span<std::byte> part(chunk.data(), std::min<uint64_t>(chunk.size(), bytes - done));
    RETURN_IF_ERROR(PReadAll(src.get(), src_offset + done, part, src_path));
    RETURN_IF_ERROR(PWriteAll(dst_fd, dst_offset + done, part, dst_path));
    sha.Update(part);
    done += part.size();
  }
  return sha.HexDigest();
}

absl::StatusOr<std::string> CopyFileAtomic(const std::string& src, const std::string& dst) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(src));
  const std::string tmp = dst + ".tmp";
  std::string sha;
  {
    int raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (raw < 0) return ErrnoError("creating", tmp, errno);
    Fd fd(raw);
    ASSIGN_OR_RETURN(sha, CopyRange(src, 0, size, fd.get(), 0, tmp));
    RETURN_IF_ERROR(FSync(fd.get(), tmp));
  }
  if (::rename(tmp.c_str(), dst.c_str()) != 0) return ErrnoError("renaming over", dst, errno);
  RETURN_IF_ERROR(FSyncDir(ParentDir(dst)));
  return sha;
}

std::string Sha256Hex(std::span<const std::byte> data) {
  Sha256 sha;
  sha.Update(data);
  return sha.HexDigest();
}

std::string Sha256Hex(const std::string& text) { return Sha256Hex(AsBytes(text)); }

absl::StatusOr<std::string> Sha256FileRange(const std::string& path, uint64_t offset,
                                            uint64_t bytes) {
  ASSIGN_OR_RETURN(Fd fd, OpenForRead(path));
  Sha256 sha;
  std::vector<std::byte> chunk(std::min<uint64_t>(bytes, kChunkBytes));
  uint64_t done = 0;
  while (done < bytes) {
    std::span<std::byte> part(chunk.data(), std::min<uint64_t>(chunk.size(), bytes - done));
    RETURN_IF_ERROR(PReadAll(fd.get(), offset + done, part, path));
    sha.Update(part);
    done += part.size();
  }
  return sha.HexDigest();
}

absl::StatusOr<std::string> Sha256File(const std::string& path) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(path));
  return Sha256FileRange(path, 0, size);
}

}  // namespace nq::format
