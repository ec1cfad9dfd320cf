#include "services/worker/slot_arena_memory.h"

#include <unistd.h>

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/shared_memory.h"
#include "services/common/slot_geometry.h"
#include "services/common/status_macros.h"

#ifdef NQ_HAVE_CUDA
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/ipc_arena.h"
#endif

namespace nq::worker {
namespace {

class HostSlotArena final : public SlotArenaMemory {
 public:
  explicit HostSlotArena(SharedMemory memory) : memory_(std::move(memory)) {}
  const std::byte* base() const override { return reinterpret_cast<const std::byte*>(memory_.data()); }
  std::span<const std::byte> host_view() const override { return {base(), memory_.size()}; }
  uint64_t bytes() const override { return memory_.size(); }
  absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
    RETURN_IF_ERROR(CheckArenaRange("read", offset, out.size(), bytes()));
    std::copy_n(base() + offset, out.size(), out.begin());
    return absl::OkStatus();
  }
  void Describe(nq::v1::RegisterWorkerRequest& request) const override {
    request.mutable_shm()->set_name(memory_.name());
    request.mutable_shm()->set_bytes(memory_.size());
  }
  std::string name() const override { return "shm " + memory_.name(); }

 private:
  SharedMemory memory_;
};

std::string ArenaName(int rank) {
  // Unique per process and start, so a restarted worker never collides with a name a dead
  // predecessor left behind.
  std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("/nq-arena-r%d-%d-%08x", rank, getpid(), static_cast<uint32_t>(rng()));
}

#ifdef NQ_HAVE_CUDA
class DeviceSlotArena final : public SlotArenaMemory {
 public:
  DeviceSlotArena(int gpu, std::unique_ptr<kernels::cuda::DeviceArena> arena) : gpu_(gpu), arena_(std::move(arena)) {}
  const std::byte* base() const override { return arena_->data(); }
  std::span<const std::byte> host_view() const override { return {}; }
  uint64_t bytes() const override { return arena_->bytes(); }
  absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
    RETURN_IF_ERROR(CheckArenaRange("read", offset, out.size(), bytes()));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu_));
    NQ_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.data(), base() + offset, out.size(), cudaMemcpyDeviceToHost));
    return absl::OkStatus();
  }
  void Describe(nq::v1::RegisterWorkerRequest& request) const override {
    const kernels::cuda::IpcArenaHandle& handle = arena_->handle();
    nq::v1::CudaIpcArena& ipc = *request.mutable_cuda_ipc();
    ipc.set_mem_handle(handle.memory.data(), handle.memory.size());
    ipc.set_event_handle(handle.event.data(), handle.event.size());
    ipc.set_device_uuid(handle.device_uuid.data(), handle.device_uuid.size());
    ipc.set_bytes(handle.bytes);
  }
  std::string name() const override { return absl::StrCat("cuda device ", gpu_); }

 private:
  int gpu_;
  std::unique_ptr<kernels::cuda::DeviceArena> arena_;
};
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<SlotArenaMemory>> SlotArenaMemory::CreateHost(int rank, uint64_t bytes) {
  ASSIGN_OR_RETURN(SharedMemory memory, SharedMemory::Create(ArenaName(rank), bytes));
  return std::make_unique<HostSlotArena>(std::move(memory));
}

absl::StatusOr<std::unique_ptr<SlotArenaMemory>> SlotArenaMemory::CreateDevice(int gpu, uint64_t bytes) {
#ifdef NQ_HAVE_CUDA
  absl::StatusOr<std::unique_ptr<kernels::cuda::DeviceArena>> arena = kernels::cuda::DeviceArena::Allocate(gpu, bytes);
  if (!arena.ok()) {
    return absl::Status(arena.status().code(), absl::StrCat("slot arena of ", bytes, " bytes on CUDA device ", gpu,
                                                            ": ", arena.status().message()));
  }
  return std::make_unique<DeviceSlotArena>(gpu, *std::move(arena));
#else
  (void)gpu;
  (void)bytes;
  return absl::UnimplementedError("a device slot arena needs a build with CUDA (cmake --preset cuda)");
#endif
}

}  // namespace nq::worker
