#include "kernels/cuda/ipc_arena.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Allocate(int device, uint64_t bytes) {
  std::unique_ptr<DeviceArena> arena(new DeviceArena());
  arena->device_ = device;
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* data = nullptr;
  NQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes));
  arena->data_ = static_cast<std::byte*>(data);
  NQ_CUDA_RETURN_IF_ERROR(cudaMemset(data, 0, bytes));
  // Interprocess events must not time (cudaEventInterprocess requires DisableTiming).
  NQ_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&arena->event_, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcMemHandle_t memory;
  NQ_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&memory, data));
  cudaIpcEventHandle_t event;
  NQ_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&event, arena->event_));
  cudaDeviceProp prop;
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  std::memcpy(arena->handle_.memory.data(), &memory, sizeof(memory));
  std::memcpy(arena->handle_.event.data(), &event, sizeof(event));
  std::memcpy(arena->handle_.device_uuid.data(), &prop.uuid, sizeof(prop.uuid));
  arena->handle_.bytes = bytes;
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return arena;
}

DeviceArena::~DeviceArena() {
  // Destructors cannot report; the process is giving the memory back either way.
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
  if (data_ != nullptr) (void)cudaFree(data_);
}

absl::Status DeviceArena::OrderAfterLoads(cudaStream_t stream) const {
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, event_, 0));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<IpcArenaMapping>> IpcArenaMapping::Open(const IpcArenaHandle& handle) {
  int count = 0;
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  int device = -1;
  for (int d = 0; d < count && device < 0; ++d) {
    cudaDeviceProp prop;
    NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, d));
    if (std::memcmp(&prop.uuid, handle.device_uuid.data(), sizeof(prop.uuid)) == 0) device = d;
  }
  if (device < 0) {
    return absl::NotFoundError(absl::StrCat("no visible CUDA device has the arena's UUID (", count, " visible)"));
  }
  std::unique_ptr<IpcArenaMapping> mapping(new IpcArenaMapping());
  mapping->device_ = device;
  mapping->bytes_ = handle.bytes;
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaIpcMemHandle_t memory;
  std::memcpy(&memory, handle.memory.data(), sizeof(memory));
  void* data = nullptr;
  NQ_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&data, memory, cudaIpcMemLazyEnablePeerAccess));
  mapping->data_ = static_cast<std::byte*>(data);
  cudaIpcEventHandle_t event;
  std::memcpy(&event, handle.event.data(), sizeof(event));
  NQ_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&mapping->event_, event));
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&mapping->stream_, cudaStreamNonBlocking));
  return mapping;
}

IpcArenaMapping::~IpcArenaMapping() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
  if (data_ != nullptr) (void)cudaIpcCloseMemHandle(data_);
}

absl::Status IpcArenaMapping::Write(uint64_t offset, std::span<const std::byte> source) {
  if (offset > bytes_ || source.size() > bytes_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("write of ", source.size(), " bytes at ", offset, " leaves the arena of ",
                                              bytes_, " bytes"));
  }
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  NQ_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(data_ + offset, source.data(), source.size(), cudaMemcpyHostToDevice, stream_));
  NQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream_));
  // READY is announced only after the copy is complete on the device (DESIGN.md section 4).
  NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status PinHostMemory(std::span<std::byte> memory) {
  NQ_CUDA_RETURN_IF_ERROR(cudaHostRegister(memory.data(), memory.size(), cudaHostRegisterPortable));
  return absl::OkStatus();
}

absl::Status UnpinHostMemory(std::span<std::byte> memory) {
  NQ_CUDA_RETURN_IF_ERROR(cudaHostUnregister(memory.data()));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MappedHostMemory>> MappedHostMemory::Map(int device, std::span<std::byte> memory) {
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  NQ_CUDA_RETURN_IF_ERROR(cudaHostRegister(memory.data(), memory.size(), cudaHostRegisterMapped));
  void* alias = nullptr;
  if (const cudaError_t err = cudaHostGetDevicePointer(&alias, memory.data(), 0); err != cudaSuccess) {
    (void)cudaHostUnregister(memory.data());
    return CudaStatus(err, "cudaHostGetDevicePointer");
  }
  return std::unique_ptr<MappedHostMemory>(new MappedHostMemory(memory.data(), static_cast<std::byte*>(alias)));
}

MappedHostMemory::~MappedHostMemory() {
  // Destructors cannot report; the registration ends with the process either way.
  (void)cudaHostUnregister(host_);
}

}  // namespace nq::kernels::cuda
