// Where an op finds the position of its first token: the RoPE angles, the KV-cache rows a write
// lands in, and the keys attention and the DSA indexer may see.
//
// A host position is fixed when the op is enqueued (every forward on the CPU, prefill and eager
// decode on the GPU). A device position is an I32 [1] tensor the kernels read when they run: a
// decode step captured once as a CUDA graph (Model's step graphs) then replays at every position
// up to `bound`. Everything decided when the op is enqueued (argument checks against the cache,
// grids, scratch sizes) uses the bound, so the same launch serves every position up to it; the
// kernels take the keys each query really sees from the device value.
//
// A device value above the bound is the caller's bug. The CPU backend refuses it
// (InvalidArgument, it reads the value when the op runs); the CUDA kernels cannot report it and
// instead stay inside the buffers they were sized for (a KV write past the cache is dropped).
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace nq::kernels {

class StepPosition {
 public:
  // A host position (implicit: most callers pass a plain integer).
  StepPosition(std::int64_t position) : bound_(position) {}  // NOLINT(google-explicit-constructor)

  // The position in `position` (I32 [1] on the op's backend), read when the op runs; at most
  // `bound`. The tensor must outlive every op (and every graph) that reads it.
  static StepPosition OnDevice(const Tensor& position, std::int64_t bound) {
    StepPosition p(bound);
    p.device_ = &position;
    return p;
  }

  // The tensor holding the position, or null for a host position.
  const Tensor* device() const { return device_; }
  // The host position, or the largest value the device tensor may hold.
  std::int64_t bound() const { return bound_; }

 private:
  std::int64_t bound_;
  const Tensor* device_ = nullptr;
};

}  // namespace nq::kernels
