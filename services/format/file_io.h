// File primitives for the release format: RAII descriptors, whole-range reads and writes
// that turn every syscall result into a Status, atomic replacement (tmp + fsync + rename +
// fsync of the directory), and SHA-256 over files and byte ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::format {

// An owned file descriptor; closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.Release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();

  int get() const { return fd_; }
  int Release();

 private:
  int fd_ = -1;
};

absl::StatusOr<Fd> OpenForRead(const std::string& path);
// Opens (creating if missing, never truncating) for positioned writes.
absl::StatusOr<Fd> OpenForWrite(const std::string& path);

// Reads exactly out.size() bytes at `offset`; OUT_OF_RANGE if the file ends first.
absl::Status PReadAll(int fd, uint64_t offset, std::span<std::byte> out, const std::string& path);
absl::Status PWriteAll(int fd, uint64_t offset, std::span<const std::byte> data,
                       const std::string& path);
absl::Status FSync(int fd, const std::string& path);
absl::Status Truncate(int fd, uint64_t size, const std::string& path);

// NOT_FOUND when the file does not exist.
absl::StatusOr<uint64_t> FileSize(const std::string& path);
bool FileExists(const std::string& path);
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// Creates `dir` and its parents.
absl::Status MakeDirs(const std::string& dir);
// Removes `path` if present (and fsyncs its directory); OK when it is already gone.
absl::Status RemoveFile(const std::string& path);

// Replaces `path` by `data` atomically: writes `path`.tmp, fsyncs it, renames it over
// `path`, fsyncs the directory. A reader sees the old file or the new one, never a mix.
absl::Status WriteFileAtomic(const std::string& path, std::span<const std::byte> data);
absl::Status WriteFileAtomic(const std::string& path, const std::string& text);

// Copies `bytes` bytes at `src_offset` of `src_path` to `dst_offset` of the open file
// `dst_fd` in chunks (never the whole range in memory) and returns the SHA-256 of the
// bytes copied. Does not fsync.
absl::StatusOr<std::string> CopyRange(const std::string& src_path, uint64_t src_offset,
                                      uint64_t bytes, int dst_fd, uint64_t dst_offset,
                                      const std::string& dst_path);
// Replaces `dst` by a copy of the whole file `src` atomically (as WriteFileAtomic) and
// returns the SHA-256 of the bytes copied.
absl::StatusOr<std::string> CopyFileAtomic(const std::string& src, const std::string& dst);

// Lower-case hex SHA-256.
std::string Sha256Hex(std::span<const std::byte> data);
std::string Sha256Hex(const std::string& text);
// Lower-case hex XXH3-128 (32 digits, the canonical big-endian form of xxhsum -H2): the
// per-record checksum the streamer checks every read against (rank_index.h). About 14 GB/s a
// core against SHA-256's 1.6, so one thread checks what an NVMe drive reads; it detects
// corruption, not a forger who can also rewrite the (SHA-256-checked) index.
std::string Xxh3Hex(std::span<const std::byte> data);
// SHA-256 of `bytes` bytes at `offset` in `path`; OUT_OF_RANGE when the file is shorter.
absl::StatusOr<std::string> Sha256FileRange(const std::string& path, uint64_t offset,
                                            uint64_t bytes);
absl::StatusOr<std::string> Sha256File(const std::string& path);

inline std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

}  // namespace nq::format
