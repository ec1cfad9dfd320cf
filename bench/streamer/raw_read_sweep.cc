#include "bench/streamer/raw_read_sweep.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/streamer/io_uring_reader.h"
#include "services/streamer/record_files.h"

namespace nq::streamer::bench {
namespace {

struct Block {
  int fd;
  uint64_t offset;
  uint32_t bytes;
};

// Aligned memory for the registered buffers, freed with the object.
struct AlignedBuffers {
  AlignedBuffers(unsigned count, uint64_t bytes) {
    for (unsigned i = 0; i < count; ++i) {
      auto* p = static_cast<std::byte*>(std::aligned_alloc(kDirectIoAlign, bytes));
      if (p == nullptr) return;
      spans.emplace_back(p, bytes);
    }
  }
  ~AlignedBuffers() {
    for (std::span<std::byte> s : spans) std::free(s.data());
  }
  std::vector<std::span<std::byte>> spans;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RawFiles>> RawFiles::Open(const std::vector<FileRange>& ranges) {
  std::unique_ptr<RawFiles> files(new RawFiles());
  for (const FileRange& r : ranges) {
    if (r.offset % kDirectIoAlign != 0 || r.bytes % kDirectIoAlign != 0) {
      return absl::InvalidArgumentError(absl::StrCat(r.path, ": range not aligned to ", kDirectIoAlign));
    }
    const int fd = ::open(r.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      return absl::FailedPreconditionError(
          absl::StrCat(r.path, ": cannot open with O_DIRECT (", std::strerror(err), ")"));
    }
    files->files_.push_back({.fd = fd, .offset = r.offset, .bytes = r.bytes});
  }
  return files;
}

RawFiles::~RawFiles() {
  for (const OpenRange& f : files_) ::close(f.fd);
}

uint64_t RawFiles::total_bytes() const {
  uint64_t total = 0;
  for (const OpenRange& f : files_) total += f.bytes;
  return total;
}

absl::StatusOr<RawResult> RawFiles::Read(uint64_t block_bytes, unsigned queue_depth, unsigned rounds,
                                         std::optional<uint64_t> shuffle_seed) const {
  if (block_bytes == 0 || block_bytes % kDirectIoAlign != 0 || block_bytes > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("block of ", block_bytes, " bytes"));
  }
  std::vector<Block> blocks;
  std::mt19937_64 rng(shuffle_seed.value_or(0));
  for (unsigned round = 0; round < rounds; ++round) {
    const size_t first = blocks.size();
    for (const OpenRange& f : files_) {
      for (uint64_t at = 0; at < f.bytes; at += block_bytes) {
        blocks.push_back({f.fd, f.offset + at, static_cast<uint32_t>(std::min(block_bytes, f.bytes - at))});
      }
    }
    if (shuffle_seed.has_value()) std::shuffle(blocks.begin() + static_cast<std::ptrdiff_t>(first), blocks.end(), rng);
  }
  AlignedBuffers buffers(queue_depth, block_bytes);
  if (buffers.spans.size() != queue_depth) return absl::ResourceExhaustedError("raw reader: buffers");
  ASSIGN_OR_RETURN(std::unique_ptr<IoUringReader> ring, IoUringReader::Create(queue_depth, buffers.spans));
  RawResult result{.block_bytes = block_bytes, .queue_depth = queue_depth};
  // user_data: the block's index; its buffer is the index modulo the depth, free again when
  // the block before it in that buffer completed (each buffer carries one read at a time).
  std::vector<unsigned> buffer_of(blocks.size());
  size_t next = 0;
  const auto start = std::chrono::steady_clock::now();
  for (unsigned b = 0; b < queue_depth && next < blocks.size(); ++b, ++next) {
    buffer_of[next] = b;
    RETURN_IF_ERROR(ring->SubmitReadFixed(blocks[next].fd, blocks[next].offset, blocks[next].bytes, b, next));
  }
  while (ring->in_flight() > 0) {
    ASSIGN_OR_RETURN(IoCompletion done, ring->Wait());
    RETURN_IF_ERROR(done.status);
    const Block& block = blocks[done.user_data];
    if (done.bytes != block.bytes) {
      return absl::DataLossError(absl::StrCat("raw reader: short read, ", done.bytes, " of ", block.bytes));
    }
    result.bytes += done.bytes;
    if (next < blocks.size()) {
      const unsigned b = buffer_of[done.user_data];
      buffer_of[next] = b;
      RETURN_IF_ERROR(ring->SubmitReadFixed(blocks[next].fd, blocks[next].offset, blocks[next].bytes, b, next));
      ++next;
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace nq::streamer::bench
