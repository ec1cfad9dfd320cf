// Collectives between worker processes on one host through POSIX shared memory (the CPU
// backend's tensor parallelism across processes; kernels/comm/shm_segment.h has the layout).
//
// Life of a group: rank 0 Create()s the segment (state forming), ranks 1..W-1 Attach() to it
// and check they belong (world size, and the caller's identity check against rank 0's
// identity); rank 0's WaitForPeers() turns the group ready once all have joined. From then on
// every collective is a sequence of rounds: each rank writes its part into its data area,
// arrives at a futex barrier, and reads what it needs. Ranks sum in rank order, so every rank
// ends with the same bits, and the bits a CpuCommunicator gives.
//
// Failure: a rank that dies (its alive lock turns owner-dead), leaves, posts another
// collective than its peers, or does not arrive within `timeout` breaks the group: every
// rank's pending and later collectives fail with that reason (UNAVAILABLE for a dead or
// departed peer, DEADLINE_EXCEEDED for a timeout, FAILED_PRECONDITION for a mismatch). A
// broken group stays broken; rank 0 re-forms by destroying it and creating a new one.
//
// Threads: one thread drives the collectives of a communicator. PeersAlive() and Break() may
// be called from another thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/comm/group_control.h"
#include "kernels/comm/shm_segment.h"

namespace nq::kernels {

struct ShmCommunicatorOptions {
  std::string name;  // POSIX shm name, "/nq-tp-..." (one per group on the host)
  int rank = 0;
  int world_size = 1;
  // Bytes one rank posts per round; larger collectives run in several rounds. 1 MiB holds a
  // decode step's hidden state many times over and a prefill chunk's in a few rounds.
  size_t round_bytes = size_t{1} << 20;
  // Longest wait for the peers in one round: past it the group breaks (a peer is stuck).
  absl::Duration timeout = absl::Seconds(30);
  // Rank 0: its identity, which Attach hands to the others' check.
  std::string identity;
  // Polled while waiting: true makes a wait return CANCELLED (shutdown).
  const std::atomic<bool>* stop = nullptr;
};

class ShmCommunicator final : public GroupControl {
 public:
  // Rank 0: creates the segment (replacing a stale object of that name left by a process that
  // died), mode 0600, state forming.
  static absl::StatusOr<std::unique_ptr<ShmCommunicator>> Create(const ShmCommunicatorOptions& options,
                                                                 uint64_t generation);
  // Rank > 0: joins the group rank 0 formed. UNAVAILABLE while there is nothing to join (no
  // segment yet, rank 0 still creating it, gone, or the group already formed or broken: retry);
  // FAILED_PRECONDITION when this rank does not belong (another world size, its rank taken by a
  // live process, or `check_identity(rank 0's identity)` failing): a refusal, which is also
  // written into the segment for rank 0 to report.
  static absl::StatusOr<std::unique_ptr<ShmCommunicator>> Attach(
      const ShmCommunicatorOptions& options,
      const std::function<absl::Status(absl::string_view leader_identity)>& check_identity);
  // Leaves the group: rank 0 breaks it and unlinks the name; another rank's departure breaks
  // it for the others too.
  ~ShmCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  uint64_t generation() const override;
  absl::Status AllReduceSum(Tensor& data) override;
  absl::Status AllGather(const Tensor& in, Tensor& out) override;
  absl::Status Broadcast(Tensor& data, int root) override;
  // Broadcast of raw bytes (the leader's step commands). The first round waits up to
  // `first_wait` (absl::InfiniteDuration(): as long as the peers live) instead of the timeout,
  // so a follower can idle in it between requests.
  absl::Status BroadcastBytes(std::span<std::byte> data, int root, absl::Duration first_wait) override;

  // Rank 0: waits until every rank has joined (then the group is ready) or `timeout` passes
  // (DEADLINE_EXCEEDED naming the missing ranks). Ranks that die while joining free their slot.
  absl::Status WaitForPeers(absl::Duration timeout) override;
  // Refusals written since the last call ("rank 1 (pid 123): ..."), for rank 0's log.
  std::vector<std::string> TakeRefusals() override;
  // OK while the group is ready or forming and every joined peer lives; else why not (and the
  // group is then broken).
  absl::Status PeersAlive() override;
  // Breaks the group with `reason` (the first reason wins) and wakes every waiter.
  void Break(absl::string_view reason) override;

 private:
  enum class Op : uint32_t { kAllReduceSum = 1, kAllGather = 2, kBroadcast = 3, kBroadcastBytes = 4 };
  ShmCommunicator(ShmCommunicatorOptions options, int fd, void* base, size_t bytes);

  shm::Header& header() const { return *static_cast<shm::Header*>(base_); }
  std::byte* Area(int parity, int rank) const;
  absl::Status HoldAliveLock();
  // One round: posts (op, bytes) (with `in` copied into this rank's area when non-null),
  // arrives, waits for all (at most `wait`), and checks every rank posted the same op and size.
  // Returns the parity whose areas hold the round's data.
  absl::StatusOr<int> Round(Op op, const void* in, size_t bytes, absl::Duration wait);
  absl::Status WaitArrived(uint32_t target, absl::Duration wait);
  absl::Status BrokenStatus() const;
  std::string MissingRanks(uint64_t round) const;

  ShmCommunicatorOptions options_;  // Attach takes round_bytes from the segment
  int fd_;
  void* base_;
  size_t bytes_;
  bool owns_name_ = false;  // rank 0: unlinks the name when destroyed
  uint64_t rounds_ = 0;  // rounds this rank has arrived at
  std::vector<uint32_t> refusal_seen_;
  // Holds this rank's alive lock for as long as the communicator lives: a robust mutex belongs
  // to a thread, and the caller's thread may end before the communicator does. Released through
  // a std::mutex and condition variable rather than absl::Notification: those keep no
  // process-global state, so a communicator made in a forked child of a threaded process
  // cannot inherit a lock some other thread held at the fork.
  std::thread alive_thread_;
  std::mutex release_mu_;
  std::condition_variable release_cv_;
  bool release_alive_ = false;
};

}  // namespace nq::kernels
