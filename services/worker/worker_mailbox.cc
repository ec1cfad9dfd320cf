#include "services/worker/worker_mailbox.h"

#include <unistd.h>

#include <random>
#include <utility>

#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"

#ifdef NQ_HAVE_CUDA
#include "kernels/cuda/ipc_arena.h"
#endif

namespace nq::worker {
namespace {

std::string MailboxName(int rank) {
  // Unique per process and start, as the arena's name is (slot_arena_memory.cc).
  std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("/nq-mailbox-r%d-%d-%08x", rank, getpid(), static_cast<uint32_t>(rng()));
}

}  // namespace

struct WorkerMailbox::DeviceMapping {
#ifdef NQ_HAVE_CUDA
  std::unique_ptr<kernels::cuda::MappedHostMemory> memory;
#endif
  std::byte* alias = nullptr;
};

WorkerMailbox::WorkerMailbox(SlotMailbox mailbox, std::unique_ptr<DeviceMapping> mapping, const SlotGeometry& geometry)
    : mailbox_(std::move(mailbox)), mapping_(std::move(mapping)) {
  all_rows_ = mailbox_.AllRows(mapping_ != nullptr ? mapping_->alias : nullptr);
  layers_.assign(geometry.moe_layer_ids.begin(), geometry.moe_layer_ids.end());
}

WorkerMailbox::~WorkerMailbox() = default;

absl::StatusOr<std::unique_ptr<WorkerMailbox>> WorkerMailbox::Create(const SlotGeometry& geometry, int rank,
                                                                     std::optional<int> gpu) {
  ASSIGN_OR_RETURN(SlotMailbox mailbox,
                   SlotMailbox::Create(MailboxName(rank), static_cast<uint32_t>(geometry.moe_layer_ids.size()),
                                       geometry.experts_per_layer));
  std::unique_ptr<DeviceMapping> mapping;
  if (gpu.has_value()) {
#ifdef NQ_HAVE_CUDA
    mapping = std::make_unique<DeviceMapping>();
    ASSIGN_OR_RETURN(mapping->memory, kernels::cuda::MappedHostMemory::Map(
                                          *gpu, std::span<std::byte>(mailbox.data(), mailbox.bytes())));
    mapping->alias = mapping->memory->device_alias();
#else
    return absl::UnimplementedError("a slot mailbox on a GPU needs a build with CUDA (cmake --preset cuda)");
#endif
  }
  return std::unique_ptr<WorkerMailbox>(new WorkerMailbox(std::move(mailbox), std::move(mapping), geometry));
}

}  // namespace nq::worker
