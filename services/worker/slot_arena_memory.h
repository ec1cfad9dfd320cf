// Where a worker's slot arena lives (DESIGN.md section 2): POSIX shared memory for the CPU
// backend, which the streamer maps by name; device memory for the CUDA backend, which the
// streamer opens through CUDA IPC and fills from its pinned bounce buffers. Either way the
// model reads residual records in place from base(), and the registration names the arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq::worker {

class SlotArenaMemory {
 public:
  virtual ~SlotArenaMemory() = default;

  // `bytes` of zeroed shared memory under a name unique to this process and start.
  static absl::StatusOr<std::unique_ptr<SlotArenaMemory>> CreateHost(int rank, uint64_t bytes);
  // `bytes` of zeroed memory on CUDA device `gpu` with an IPC handle. UNIMPLEMENTED in a build
  // without CUDA; RESOURCE_EXHAUSTED when the device lacks the memory.
  static absl::StatusOr<std::unique_ptr<SlotArenaMemory>> CreateDevice(int gpu, uint64_t bytes);

  // The model's view: memory of the backend's kind.
  virtual const std::byte* base() const = 0;
  // The arena as host memory (the --verify_slots hash), or empty when it lives on the device.
  virtual std::span<const std::byte> host_view() const = 0;
  virtual uint64_t bytes() const = 0;
  // Copies arena bytes [offset, offset + out.size()) to the host (--verify_slots). OUT_OF_RANGE
  // past the end.
  virtual absl::Status Read(uint64_t offset, std::span<std::byte> out) const = 0;
  // Names the arena in the streamer registration (its shm or cuda_ipc field).
  virtual void Describe(nq::v1::RegisterWorkerRequest& request) const = 0;
  // For logs: "shm /nq-arena-r0-..." or "cuda device 0".
  virtual std::string name() const = 0;
};

}  // namespace nq::worker
