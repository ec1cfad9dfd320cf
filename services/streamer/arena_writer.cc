#include "services/streamer/arena_writer.h"

#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "services/common/shared_memory.h"
#include "services/common/slot_geometry.h"
#include "services/common/status_macros.h"

#ifdef NQ_HAVE_CUDA
#include "kernels/cuda/ipc_arena.h"
#endif

namespace nq::streamer {
namespace {

class SharedMemoryArenaWriter final : public ArenaWriter {
 public:
  explicit SharedMemoryArenaWriter(SharedMemory memory) : memory_(std::move(memory)) {}
  uint64_t bytes() const override { return memory_.size(); }
  absl::Status Write(uint64_t offset, std::span<const std::byte> source) override {
    RETURN_IF_ERROR(CheckArenaRange("write", offset, source.size(), memory_.size()));
    std::memcpy(memory_.data() + offset, source.data(), source.size());
    return absl::OkStatus();
  }
  std::string shm_name() const override { return memory_.name(); }
  std::string Describe() const override { return "shm " + memory_.name(); }

 private:
  SharedMemory memory_;
};

#ifdef NQ_HAVE_CUDA
class CudaIpcArenaWriter final : public ArenaWriter {
 public:
  CudaIpcArenaWriter(std::unique_ptr<kernels::cuda::IpcArenaMapping> mapping, std::string uuid)
      : mapping_(std::move(mapping)), uuid_(std::move(uuid)) {}
  uint64_t bytes() const override { return mapping_->bytes(); }
  absl::Status Write(uint64_t offset, std::span<const std::byte> source) override {
    return mapping_->Write(offset, source);
  }
  absl::Status PrepareSource(std::span<std::byte> buffer) override { return kernels::cuda::PinHostMemory(buffer); }
  void ReleaseSource(std::span<std::byte> buffer) override { (void)kernels::cuda::UnpinHostMemory(buffer); }
  std::string Describe() const override { return "cuda-ipc (device " + uuid_ + ")"; }

 private:
  std::unique_ptr<kernels::cuda::IpcArenaMapping> mapping_;
  std::string uuid_;
};

absl::StatusOr<std::unique_ptr<ArenaWriter>> OpenCudaIpcArena(const nq::v1::CudaIpcArena& arena) {
  kernels::cuda::IpcArenaHandle handle;
  if (arena.mem_handle().size() != handle.memory.size() || arena.device_uuid().size() != handle.device_uuid.size() ||
      (!arena.event_handle().empty() && arena.event_handle().size() != handle.event.size())) {
    return absl::InvalidArgumentError("CUDA IPC arena: malformed memory, event or device handle");
  }
  if (arena.event_handle().empty()) return absl::InvalidArgumentError("CUDA IPC arena: no event handle");
  std::memcpy(handle.memory.data(), arena.mem_handle().data(), handle.memory.size());
  std::memcpy(handle.event.data(), arena.event_handle().data(), handle.event.size());
  std::memcpy(handle.device_uuid.data(), arena.device_uuid().data(), handle.device_uuid.size());
  handle.bytes = arena.bytes();
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::cuda::IpcArenaMapping> mapping,
                   kernels::cuda::IpcArenaMapping::Open(handle));
  return std::make_unique<CudaIpcArenaWriter>(std::move(mapping), absl::BytesToHexString(arena.device_uuid()));
}
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<ArenaWriter>> OpenArena(const nq::v1::RegisterWorkerRequest& request,
                                                       uint64_t expected_bytes) {
  switch (request.arena_case()) {
    case nq::v1::RegisterWorkerRequest::kShm: {
      if (request.shm().bytes() != expected_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("arena of ", request.shm().bytes(),
                                                       " bytes does not match the geometry's ", expected_bytes));
      }
      ASSIGN_OR_RETURN(SharedMemory memory, SharedMemory::Open(request.shm().name(), request.shm().bytes()));
      return std::make_unique<SharedMemoryArenaWriter>(std::move(memory));
    }
    case nq::v1::RegisterWorkerRequest::kCudaIpc: {
      if (request.cuda_ipc().bytes() != expected_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("arena of ", request.cuda_ipc().bytes(),
                                                       " bytes does not match the geometry's ", expected_bytes));
      }
#ifdef NQ_HAVE_CUDA
      return OpenCudaIpcArena(request.cuda_ipc());
#else
      return absl::UnimplementedError("this nq-streamer was built without CUDA: it cannot open CUDA IPC arenas");
#endif
    }
    default:
      return absl::InvalidArgumentError("the registration names no arena");
  }
}

}  // namespace nq::streamer
