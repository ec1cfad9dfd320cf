// Collectives between GPU worker processes over NCCL (one process per GPU, any world size).
// Rank 0 makes the unique id (NewNcclUniqueId) and hands it to the other ranks out of band
// (the leader worker passes it to its peers at startup); every rank then calls Create.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/comm/communicator.h"

namespace nq::kernels {

// NCCL_UNIQUE_ID_BYTES; a static_assert in the .cc keeps the two equal.
inline constexpr size_t kNcclUniqueIdBytes = 128;
using NcclUniqueId = std::array<char, kNcclUniqueIdBytes>;

absl::StatusOr<NcclUniqueId> NewNcclUniqueId();

class NcclCommunicator final : public Communicator {
 public:
  // Joins the world (blocks until every rank has joined). `stream` is the cudaStream_t the
  // collectives are enqueued on: the CUDA backend's stream, so they order with its kernels.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const NcclUniqueId& id, int rank,
                                                                  int world_size, int device,
                                                                  void* stream);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  absl::Status AllReduceSum(Tensor& data) override;
  absl::Status AllGather(const Tensor& in, Tensor& out) override;
  absl::Status Broadcast(Tensor& data, int root) override;

 private:
  NcclCommunicator(void* comm, void* stream, int rank, int world_size)
      : comm_(comm), stream_(stream), rank_(rank), world_size_(world_size) {}

  void* comm_;    // ncclComm_t
  void* stream_;  // cudaStream_t
  int rank_;
  int world_size_;
};

}  // namespace nq::kernels
