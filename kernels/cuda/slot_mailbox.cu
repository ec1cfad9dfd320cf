#include "kernels/cuda/slot_mailbox.cuh"

namespace nq::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// The streamer stores staged, then seq with release, from the host; the acquire at system scope
// makes the staged row (and the slot bytes it names, complete before the post) visible once the
// new seq is.
__device__ __forceinline__ std::uint32_t LoadAcquireSystem(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// staged too: a row posted after the seq this thread read carries its own slot's bytes.
__device__ __forceinline__ std::int32_t LoadAcquireSystem(const std::int32_t* p) {
  std::int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSystem(std::uint64_t* p, std::uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__global__ void __launch_bounds__(kThreads) ApplySlotMailboxKernel(SlotMailboxRow row, std::uint64_t* applied,
                                                                   std::int32_t* slot_of_expert) {
  const int e = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (e >= row.experts) return;
  std::uint64_t mine = applied[e];
  const std::uint32_t seq = LoadAcquireSystem(row.seq + e);
  if (seq != MailboxEntrySeq(mine)) {
    mine = PackMailboxEntry(seq, LoadAcquireSystem(row.staged + e));
    applied[e] = mine;
    StoreReleaseSystem(row.published + e, mine);
  }
  slot_of_expert[e] = MailboxEntrySlot(mine);
}

}  // namespace

absl::Status LaunchApplySlotMailbox(const SlotMailboxRow& row, std::uint64_t* applied, std::int32_t* slot_of_expert,
                                    const LaunchContext& ctx) {
  const unsigned blocks = static_cast<unsigned>((row.experts + kThreads - 1) / kThreads);
  ApplySlotMailboxKernel<<<blocks, kThreads, 0, ctx.stream>>>(row, applied, slot_of_expert);
  return CheckLaunch("ApplySlotMailboxKernel");
}

}  // namespace nq::kernels::cuda
