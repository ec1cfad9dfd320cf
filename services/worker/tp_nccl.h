// The NCCL data plane of a CUDA worker's tensor-parallel group (tp_data_plane.h): one
// NcclCommunicator per formed group, on the worker's CUDA stream and GPU, joined with the unique
// id rank 0 sends over the group's control channel. Built only where NCCL is (NQ_HAVE_NCCL).
#pragma once

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/worker/tp_data_plane.h"

namespace nq::worker {

// `stream`: the CUDA backend's stream (kernels::cuda::NativeStream), so the collectives order with
// the model's kernels. `collective_timeout` bounds a join and the wait at the end of each step.
absl::StatusOr<TpDataPlaneFactory> NcclDataPlaneFactory(int device, void* stream, absl::Duration collective_timeout);

}  // namespace nq::worker
