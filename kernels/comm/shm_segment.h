// The shared-memory object one tensor-parallel group of worker processes on one host shares
// (the CPU backend's transport, DESIGN.md "Tensor parallelism"). Rank 0 creates it; ranks
// 1..W-1 attach to it by name. It holds:
//   - per rank: a robust process-shared mutex the rank holds while it is attached (its
//     "alive lock": when the process dies the kernel marks the mutex owner-dead, so a peer
//     learns of the death at once, even while the dead process is an unreaped zombie, and
//     never from a pid that may have been reused), its pid, join state and a refusal text;
//   - the group state (forming / ready / broken, with the reason it broke);
//   - the barrier word every collective round waits on (a futex);
//   - per round parity and rank: what the rank posted (op, bytes) and a data area.
// Everything here is plain data with lock-free atomics, which are address-free, so they work
// across processes that map the object at different addresses.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace nq::kernels::shm {

inline constexpr uint64_t kMagic = 0x4e51'5450'5348'4d31ULL;  // "NQTPSHM1"
inline constexpr uint32_t kLayoutVersion = 1;
inline constexpr int kMaxWorld = 64;
inline constexpr size_t kTextBytes = 512;
// Collective rounds alternate between two sets of data areas, so a round needs one barrier:
// a rank writes parity p in round i + 2 only after every rank has arrived at round i + 1,
// which each does only after reading round i.
inline constexpr int kParities = 2;

enum GroupState : uint32_t { kForming = 0, kReady = 1, kBroken = 2 };
enum SlotState : uint32_t { kSlotEmpty = 0, kSlotJoined = 1, kSlotRefused = 2, kSlotLeft = 3 };

struct alignas(64) RankSlot {
  pthread_mutex_t alive;            // robust + process-shared; held by the attached rank
  std::atomic<int32_t> pid;         // the attached process (0: none)
  std::atomic<uint32_t> state;      // SlotState
  std::atomic<uint64_t> round;      // the last collective round this rank arrived at
  std::atomic<uint32_t> refusal_seq;  // bumped each time a process refuses to join as this rank
  char refusal[kTextBytes];         // why, NUL-terminated (written before refusal_seq)
};

struct alignas(64) Post {
  std::atomic<uint32_t> op;     // which collective (ShmCommunicator's Op)
  std::atomic<uint64_t> bytes;  // bytes this rank posted (or expects) this round
};

struct Header {
  std::atomic<uint64_t> magic;  // kMagic, stored last by rank 0 once all else is initialised
  uint32_t layout_version;
  uint32_t world_size;
  uint64_t generation;   // rank 0's count of groups it formed under this name
  uint64_t round_bytes;  // bytes of one data area
  char identity[kTextBytes];  // rank 0's identity, which the others check theirs against
  std::atomic<uint32_t> state;        // GroupState
  std::atomic<uint32_t> broken_once;  // 0 -> 1 by the rank that writes broken_reason
  char broken_reason[kTextBytes];     // written before state becomes kBroken
  alignas(64) std::atomic<uint32_t> arrived;  // futex word: barrier arrivals, wraps
  RankSlot ranks[kMaxWorld];
  Post posts[kParities][kMaxWorld];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free &&
              std::atomic<int32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word must be a plain u32");

inline constexpr size_t kDataOffset = (sizeof(Header) + 4095) / 4096 * 4096;

inline size_t SegmentBytes(int world_size, size_t round_bytes) {
  return kDataOffset + static_cast<size_t>(kParities) * static_cast<size_t>(world_size) * round_bytes;
}

}  // namespace nq::kernels::shm
