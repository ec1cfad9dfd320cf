// The slot arena record_read_bench copies records into, opened through the streamer's own
// OpenArena (services/streamer/arena_writer.h) so the copy is the one nq-streamer does:
//   shm:      a POSIX shared-memory arena (the CPU backend's), created here as a worker would;
//   cuda_ipc: a device arena (CUDA IPC, GPU workers) allocated by a forked child playing the
//             worker (CUDA IPC cannot open a handle in the process that exported it), only
//             in a build with CUDA (NQ_HAVE_CUDA).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "services/common/shared_memory.h"
#include "services/streamer/arena_writer.h"

namespace nq::streamer::bench {

class BenchArena {
 public:
  // `kind`: "shm" or "cuda_ipc". INVALID_ARGUMENT for another kind; UNIMPLEMENTED for
  // cuda_ipc without CUDA; OpenArena's errors.
  static absl::StatusOr<std::unique_ptr<BenchArena>> Create(const std::string& kind, uint64_t bytes);
  ~BenchArena();
  BenchArena(const BenchArena&) = delete;
  BenchArena& operator=(const BenchArena&) = delete;

  ArenaWriter& writer() { return *writer_; }

 private:
  BenchArena() = default;
  std::optional<SharedMemory> shm_;  // the worker's side of a shm arena
  pid_t worker_pid_ = -1;            // the child holding a device arena
  int worker_pipe_ = -1;             // closing it lets the child exit
  std::unique_ptr<ArenaWriter> writer_;
};

}  // namespace nq::streamer::bench
