// Slot arenas in device memory shared between processes with CUDA IPC (DESIGN.md sections 2
// and 4): the worker allocates its arena and exports a handle; the streamer opens it and
// copies records from its pinned bounce buffers into FREE slots. A copy is complete on the
// device before the streamer announces READY (the copy's stream is synchronised), and an
// interprocess event recorded after it lets a worker order its own stream after the copy.
// Requires the two processes to share the IPC and PID namespaces and see the same device.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"

namespace nq::kernels::cuda {

// What travels in nq.v1.CudaIpcArena.
struct IpcArenaHandle {
  std::array<char, sizeof(cudaIpcMemHandle_t)> memory{};
  std::array<char, sizeof(cudaIpcEventHandle_t)> event{};
  std::array<char, 16> device_uuid{};  // cudaDeviceProp::uuid of the device holding it
  uint64_t bytes = 0;
};

// The worker's arena: device memory and the interprocess event, freed with the object.
class DeviceArena {
 public:
  // Zero-filled `bytes` on `device`. FAILED_PRECONDITION without a device;
  // RESOURCE_EXHAUSTED when the memory is not there.
  static absl::StatusOr<std::unique_ptr<DeviceArena>> Allocate(int device, uint64_t bytes);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  std::byte* data() const { return data_; }
  uint64_t bytes() const { return handle_.bytes; }
  const IpcArenaHandle& handle() const { return handle_; }
  // Makes `stream` wait for the copy after which the streamer last recorded the event.
  absl::Status OrderAfterLoads(cudaStream_t stream) const;

 private:
  DeviceArena() = default;
  int device_ = 0;
  std::byte* data_ = nullptr;
  cudaEvent_t event_ = nullptr;
  IpcArenaHandle handle_;
};

// The streamer's view of a worker's arena.
class IpcArenaMapping {
 public:
  // Finds the device by UUID and opens the memory and event handles. NOT_FOUND when no
  // visible device has the UUID; the CUDA error otherwise (e.g. a handle from this process).
  static absl::StatusOr<std::unique_ptr<IpcArenaMapping>> Open(const IpcArenaHandle& handle);
  ~IpcArenaMapping();
  IpcArenaMapping(const IpcArenaMapping&) = delete;
  IpcArenaMapping& operator=(const IpcArenaMapping&) = delete;

  uint64_t bytes() const { return bytes_; }
  // Copies `source` (host memory, pinned for an asynchronous copy: see PinHostMemory) to
  // `offset`, records the interprocess event, and returns once the copy is complete on the
  // device. OUT_OF_RANGE when the range leaves the arena.
  absl::Status Write(uint64_t offset, std::span<const std::byte> source);

 private:
  IpcArenaMapping() = default;
  int device_ = 0;
  std::byte* data_ = nullptr;
  uint64_t bytes_ = 0;
  cudaEvent_t event_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Page-locks host memory (the record store's bounce buffers) so copies from it run
// asynchronously at full PCIe bandwidth; UnpinHostMemory undoes it.
absl::Status PinHostMemory(std::span<std::byte> memory);
absl::Status UnpinHostMemory(std::span<std::byte> memory);

// Host memory that kernels on one device read and write in place (a worker's slot mailbox,
// services/common/slot_mailbox.h): page-locked and mapped into the device's address space until
// destroyed. The memory must outlive the mapping.
class MappedHostMemory {
 public:
  static absl::StatusOr<std::unique_ptr<MappedHostMemory>> Map(int device, std::span<std::byte> memory);
  ~MappedHostMemory();
  MappedHostMemory(const MappedHostMemory&) = delete;
  MappedHostMemory& operator=(const MappedHostMemory&) = delete;
  // The memory's address on the device.
  std::byte* device_alias() const { return alias_; }

 private:
  MappedHostMemory(std::byte* host, std::byte* alias) : host_(host), alias_(alias) {}
  std::byte* host_;
  std::byte* alias_;
};

}  // namespace nq::kernels::cuda
