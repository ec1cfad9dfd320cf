// Collectives between threads of one process: a world of W ranks, each driven by its own
// thread with its own CPU backend. Used by the CPU backend's tensor parallelism and by the
// tests that check W = 2 and W = 4 give the logits of W = 1.
#pragma once

#include <barrier>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/comm/communicator.h"

namespace nq::kernels {

class CpuCommunicatorGroup;

class CpuCommunicator final : public Communicator {
 public:
  int rank() const override { return rank_; }
  int world_size() const override;
  absl::Status AllReduceSum(Tensor& data) override;
  absl::Status AllGather(const Tensor& in, Tensor& out) override;
  absl::Status Broadcast(Tensor& data, int root) override;

 private:
  friend class CpuCommunicatorGroup;
  CpuCommunicator(std::shared_ptr<CpuCommunicatorGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  std::shared_ptr<CpuCommunicatorGroup> group_;
  int rank_;
};

// Shared state of one world. Create() returns one communicator per rank; hand each to the
// thread that drives that rank.
class CpuCommunicatorGroup : public std::enable_shared_from_this<CpuCommunicatorGroup> {
 public:
  static absl::StatusOr<std::vector<std::unique_ptr<CpuCommunicator>>> Create(int world_size);
  explicit CpuCommunicatorGroup(int world_size);

 private:
  friend class CpuCommunicator;
  // Every rank posts its buffer, waits for all, does its part, and waits again so no buffer
  // is reused while another rank still reads it.
  struct Posted {
    const float* in = nullptr;
    float* out = nullptr;
    int64_t n = 0;
  };

  const int world_size_;
  std::vector<Posted> posted_;
  std::barrier<> barrier_;
};

}  // namespace nq::kernels
