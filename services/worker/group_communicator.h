// The communicator a tensor-parallel worker's model holds for its whole life, while the group
// behind it comes and goes: a rank that dies breaks the group, rank 0 forms a new one, and the
// model (loaded once, minutes for a large checkpoint) keeps this same pointer. Collectives
// while no group is set fail UNAVAILABLE.
//
// Threads: Set() is called by whoever forms or joins the group, only while no collective runs
// (the leader holds its sequence lease; a follower runs its commands on the thread that joins).
#pragma once

#include <atomic>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/comm/communicator.h"

namespace nq::worker {

class GroupCommunicator final : public kernels::Communicator {
 public:
  GroupCommunicator(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

  void Set(kernels::Communicator* group) { group_.store(group, std::memory_order_release); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  absl::Status AllReduceSum(kernels::Tensor& data) override {
    kernels::Communicator* g = Current();
    return g == nullptr ? NoGroup() : g->AllReduceSum(data);
  }
  absl::Status AllGather(const kernels::Tensor& in, kernels::Tensor& out) override {
    kernels::Communicator* g = Current();
    return g == nullptr ? NoGroup() : g->AllGather(in, out);
  }
  absl::Status Broadcast(kernels::Tensor& data, int root) override {
    kernels::Communicator* g = Current();
    return g == nullptr ? NoGroup() : g->Broadcast(data, root);
  }

 private:
  kernels::Communicator* Current() const { return group_.load(std::memory_order_acquire); }
  absl::Status NoGroup() const {
    return absl::UnavailableError(
        absl::StrCat("rank ", rank_, ": the tensor-parallel group of ", world_size_, " ranks is not formed"));
  }

  const int rank_;
  const int world_size_;
  std::atomic<kernels::Communicator*> group_{nullptr};
};

}  // namespace nq::worker
