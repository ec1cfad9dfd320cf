// Collectives between GPU worker processes over NCCL (one process per GPU, any world size).
// Rank 0 makes the unique id (NewNcclUniqueId) and hands it to the other ranks out of band (the
// worker sends it over its group's control channel, services/worker/tp_bootstrap.h); every rank
// then calls Create.
//
// Why non-blocking communicators (ncclConfig_t.blocking = 0): a blocking ncclCommInitRank waits
// for every rank with no way out, so a peer that dies while the group forms would hang the others
// for good. Here the join polls, checks the caller's `peers_alive` and a deadline, and aborts.
// Likewise a collective waiting for a dead peer never completes on the device: Abort() (from a
// watchdog thread) releases it, and every later call fails with the reason.
//
// Collectives are enqueued on the stream given at Create (the CUDA backend's), so they order with
// its kernels and may be captured into a CUDA graph; they return once enqueued.
//
// Threads: one thread issues the collectives; Health() and Abort() may be called from another.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/comm/communicator.h"

namespace nq::kernels {

// NCCL_UNIQUE_ID_BYTES; a static_assert in the .cc keeps the two equal.
inline constexpr size_t kNcclUniqueIdBytes = 128;
using NcclUniqueId = std::array<char, kNcclUniqueIdBytes>;

absl::StatusOr<NcclUniqueId> NewNcclUniqueId();
// ncclGetVersion() of the library this process runs (e.g. 22809 for 2.28.9).
absl::StatusOr<int> NcclVersion();

struct NcclCommunicatorOptions {
  int rank = 0;
  int world_size = 1;
  int device = 0;          // the CUDA device this rank runs on (cudaSetDevice before the join)
  void* stream = nullptr;  // cudaStream_t the collectives are enqueued on
  // Longest join, and longest wait for an enqueue NCCL finishes on its own thread (it may connect
  // to the peers first): past it the communicator is aborted (DEADLINE_EXCEEDED).
  absl::Duration join_timeout = absl::Seconds(120);
  // Polled while joining, settling an enqueue and in WaitForStream: its error ends the wait (the
  // group broke). Settling calls it under the communicator's lock: it must not call back into it.
  std::function<absl::Status()> peers_alive;
};

class NcclCommunicator final : public Communicator {
 public:
  // Joins the world (every rank must call it with the same id).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const NcclUniqueId& id,
                                                                  const NcclCommunicatorOptions& options);
  ~NcclCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  // F32 or BF16 (the device sums in the tensor's dtype).
  absl::Status AllReduceSum(Tensor& data) override;
  absl::Status AllGather(const Tensor& in, Tensor& out) override;
  absl::Status Broadcast(Tensor& data, int root) override;
  // Enqueued on the stream given at Create, so a graph captured there records them.
  bool CanCapture() const override { return true; }
  absl::Status CheckCompleted() override { return WaitForStream(options_.join_timeout); }

  // OK while neither aborted nor failed asynchronously (ncclCommGetAsyncError); else why.
  absl::Status Health();
  // Aborts the communicator (ncclCommAbort): operations still on the device end, later calls fail
  // UNAVAILABLE with `reason`. Idempotent; the first reason is kept.
  void Abort(absl::string_view reason);
  // Waits until the work enqueued on the stream so far has run, checking Health(), peers_alive and
  // `timeout` as it polls; on a failure aborts and returns why (so a step whose collective was cut
  // short fails rather than hands on what the buffers held). OK at once while the stream is being
  // captured (the graph's launch waits instead).
  absl::Status WaitForStream(absl::Duration timeout);

 private:
  NcclCommunicator(void* comm, void* event, NcclCommunicatorOptions options)
      : comm_(comm), event_(event), options_(std::move(options)) {}
  // Under mu_: the abort status, or the communicator's asynchronous error.
  absl::Status HealthLocked();
  void AbortLocked(absl::string_view reason);
  // Under mu_: after an enqueue that answered ncclInProgress, polls until it is done (watching
  // peers_alive, at most join_timeout); aborts the communicator when it is not.
  absl::Status Settle(const char* what, int result);

  std::mutex mu_;        // serialises every NCCL call on comm_ (Abort comes from another thread)
  void* comm_;           // ncclComm_t; null once aborted
  void* event_;          // cudaEvent_t for WaitForStream
  NcclCommunicatorOptions options_;
  std::string aborted_;  // why, once aborted
};

}  // namespace nq::kernels
