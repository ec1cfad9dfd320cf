// Tensor-parallel collectives (DESIGN.md "Tensor parallelism"): one all-reduce after
// attention and one after the MoE block per layer, plus broadcast and all-gather. Two
// implementations: CpuCommunicator (ranks are threads of one process; tests and the CPU
// backend) and NcclCommunicator (one process per GPU).
//
// Contract: every rank calls the same collectives in the same order with the same sizes;
// buffers are F32 tensors of the backend the communicator was made for. A collective on
// one rank blocks until all ranks have joined it (CPU) or is enqueued on the backend's
// stream (NCCL).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/tensor.h"

namespace nq::kernels {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // data = sum over ranks of data, identical bits on every rank. F32 only.
  virtual absl::Status AllReduceSum(Tensor& data) = 0;
  // out[r * n .. (r + 1) * n) = in of rank r, where n = in.NumElements(); out holds
  // world_size * n elements. F32 only.
  virtual absl::Status AllGather(const Tensor& in, Tensor& out) = 0;
  // data = data of rank `root` on every rank. F32 only.
  virtual absl::Status Broadcast(Tensor& data, int root) = 0;

  // Whether the collectives may be recorded into a backend graph (Backend::BeginCapture): NCCL
  // enqueued on the CUDA backend's stream can; the CPU transports run each call on the calling
  // thread and cannot.
  virtual bool CanCapture() const { return false; }
  // After a captured step ran: OK when every collective it held completed, else why one was cut
  // short (a dead peer, an abort), so the step fails instead of handing on what the buffers held.
  // A transport whose calls complete before they return has nothing to check.
  virtual absl::Status CheckCompleted() { return absl::OkStatus(); }
};

}  // namespace nq::kernels
