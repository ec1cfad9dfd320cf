// Programmatic dependent launch (Hopper): a kernel launched this way may start while the kernel
// before it on the stream is still running, once every block of that kernel has executed
// griddepcontrol.launch_dependents (or exited). Its launch latency and whatever it does before
// griddepcontrol.wait (plans, prefetches, independent loads) then overlap the earlier kernel; the
// wait returns once that kernel has completed and its memory is visible. A kernel launched
// this way must execute griddepcontrol.wait before it reads anything the earlier kernel writes.
// Stream-ordered, capturable in a CUDA graph (the dependency becomes a programmatic edge).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"

namespace nq::kernels::cuda {

template <typename... Params, typename... Args>
absl::Status LaunchProgrammaticDependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                                         const LaunchContext& ctx, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = ctx.stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return CudaStatus(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "cudaLaunchKernelEx");
}

// In a kernel launched that way: wait for the kernel before it (completed, memory visible).
__device__ __forceinline__ void WaitForPrerequisiteGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Let the next kernel, if launched that way, start now (it still waits for this one to finish).
__device__ __forceinline__ void LetDependentsLaunch() { asm volatile("griddepcontrol.launch_dependents;"); }
// The prologue of a small kernel launched that way that has nothing to do before its inputs:
// wait for them first thing (every block, before any early return, so the kernel never completes
// ahead of the one it follows), then let the next kernel launch and load its weights meanwhile.
__device__ __forceinline__ void StartAsProgrammaticDependent() {
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();
}

}  // namespace nq::kernels::cuda
