// Small device-to-host copies as a kernel storing into page-locked host memory (under unified
// addressing its host address is a device address), instead of a copy-engine transfer.
//
// Why: a decode step ends with two small copies to the host (the sampled ids, the final hidden
// state) and each MoE layer logs its routing the same way. As copy nodes in a step's graph they
// cost a replay 5-10 us (graph_launch_bench, bench/README.md) and break the programmatic launch of
// the kernel after them; as a kernel the copy is one more programmatic dependent, its stores
// posted over the bus as the kernel runs. Larger copies keep the copy engine, whose bandwidth a
// kernel's stores over the bus do not match.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

// The largest copy the kernel takes (CudaBackend::DoCopyToHostAsync): a step's outputs and a
// layer's routing log are a few KiB; a vocabulary's logits (~0.5-1 MB) stay on the copy engine.
inline constexpr std::size_t kMappedHostCopyMaxBytes = std::size_t{128} << 10;

// dst: page-locked host memory (its host address, valid on the device under unified addressing);
// src: device memory; any alignment. A programmatic dependent of the kernel before it (it reads src
// only after that kernel is complete), stream-ordered and capturable. bytes <= kMappedHostCopyMaxBytes.
absl::Status LaunchMappedHostCopy(const void* src, void* dst, std::size_t bytes, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
