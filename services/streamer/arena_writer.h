// Where the streamer writes a worker's slots (DESIGN.md section 2): the worker's arena in
// POSIX shared memory (CPU backend) or in device memory opened through CUDA IPC (GPU
// workers; needs a streamer built with CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq::streamer {

class ArenaWriter {
 public:
  virtual ~ArenaWriter() = default;
  virtual uint64_t bytes() const = 0;
  // Copies `source` to `offset` and returns once the worker would read the new bytes (host
  // memory: at once; device memory: the copy is complete on the device). OUT_OF_RANGE when
  // the range leaves the arena.
  virtual absl::Status Write(uint64_t offset, std::span<const std::byte> source) = 0;
  // Prepares a host buffer the writes come from (device arenas page-lock it) and undoes it;
  // Release before the buffer is freed.
  virtual absl::Status PrepareSource(std::span<std::byte> buffer) { return absl::OkStatus(); }
  virtual void ReleaseSource(std::span<std::byte> buffer) {}
  // The shared-memory name a dead worker leaves behind, to unlink; empty for device arenas
  // (the driver frees them with the process).
  virtual std::string shm_name() const { return ""; }
  // For logs: "shm /nq-arena-r0-..." or "cuda-ipc (device <uuid>)".
  virtual std::string Describe() const = 0;
};

// Maps the arena a RegisterWorkerRequest names, checking its size against `expected_bytes`
// (the geometry's). INVALID_ARGUMENT for a size mismatch or no arena; NOT_FOUND when the
// arena cannot be opened; UNIMPLEMENTED for a CUDA IPC arena in a streamer built without CUDA.
absl::StatusOr<std::unique_ptr<ArenaWriter>> OpenArena(const nq::v1::RegisterWorkerRequest& request,
                                                       uint64_t expected_bytes);

}  // namespace nq::streamer
