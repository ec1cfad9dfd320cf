// The communicator a tensor-parallel worker's model holds for its whole life, while the group
// behind it comes and goes: a rank that dies breaks the group, rank 0 forms a new one, and the
// model (loaded once, minutes for a large checkpoint) keeps this same pointer. Collectives
// while no group is set fail UNAVAILABLE.
//
// It also times every collective on the calling thread (nq_worker_tp_collective_seconds, and
// the running total TakeCollectiveSeconds hands to a per-step histogram): the share of a decode
// step spent communicating is the figure tensor parallelism is judged by (bench/README.md). On
// the CPU transport a call's time includes waiting for the slowest rank; on NCCL it is the
// enqueue only (the collective runs on the device stream, asynchronously).
//
// Threads: Set() is called by whoever forms or joins the group, only while no collective runs
// (the leader holds its sequence lease; a follower runs its commands on the thread that joins).
// TakeCollectiveSeconds() is called by the thread that runs the collectives.
#pragma once

#include <atomic>
#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/comm/communicator.h"
#include "services/common/metrics/buckets.h"
#include "services/common/metrics/registry.h"

namespace nq::worker {

class GroupCommunicator final : public kernels::Communicator {
 public:
  GroupCommunicator(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

  void Set(kernels::Communicator* group) { group_.store(group, std::memory_order_release); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  absl::Status AllReduceSum(kernels::Tensor& data) override {
    return Timed(all_reduce_, [&](kernels::Communicator& g) { return g.AllReduceSum(data); });
  }
  absl::Status AllGather(const kernels::Tensor& in, kernels::Tensor& out) override {
    return Timed(all_gather_, [&](kernels::Communicator& g) { return g.AllGather(in, out); });
  }
  absl::Status Broadcast(kernels::Tensor& data, int root) override {
    return Timed(broadcast_, [&](kernels::Communicator& g) { return g.Broadcast(data, root); });
  }

  // Seconds spent inside collectives since the last call (the step boundary's caller).
  double TakeCollectiveSeconds() { return std::exchange(pending_seconds_, 0.0); }

 private:
  // 10 us .. ~80 ms: a shared-memory round is tens of microseconds, a prefill chunk's many.
  static metrics::HistogramFamily& Family() {
    return metrics::Registry::Default().Histogram(
        "nq_worker_tp_collective_seconds",
        "Time of one tensor-parallel collective on the calling thread (CPU transport: until every rank's part "
        "is summed, waiting for the slowest rank included; NCCL: the enqueue, except the logits' all_gather, "
        "which waits for the stream and so includes the forward queued before it)",
        metrics::ExponentialBuckets(1e-5, 2, 14), {"op"});
  }

  template <typename Call>
  absl::Status Timed(metrics::Histogram& histogram, Call call) {
    kernels::Communicator* g = Current();
    if (g == nullptr) return NoGroup();
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = call(*g);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    histogram.Observe(seconds);
    pending_seconds_ += seconds;
    return status;
  }

  kernels::Communicator* Current() const { return group_.load(std::memory_order_acquire); }
  absl::Status NoGroup() const {
    return absl::UnavailableError(
        absl::StrCat("rank ", rank_, ": the tensor-parallel group of ", world_size_, " ranks is not formed"));
  }

  const int rank_;
  const int world_size_;
  std::atomic<kernels::Communicator*> group_{nullptr};
  metrics::Histogram& all_reduce_ = Family().WithLabels({"all_reduce"});
  metrics::Histogram& all_gather_ = Family().WithLabels({"all_gather"});
  metrics::Histogram& broadcast_ = Family().WithLabels({"broadcast"});
  double pending_seconds_ = 0;  // the collective thread's only
};

}  // namespace nq::worker
