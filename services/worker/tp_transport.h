// Which transport a tensor-parallel worker's model collectives run on (tp_data_plane.h): on the
// CPU backend the group's shared-memory segment (no data plane); on CUDA, NCCL on the backend's
// stream when this build has NCCL, and a refusal naming what is missing when it has not.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "services/worker/tp_data_plane.h"

namespace nq::worker {

// Whether this nq-worker was built with the NCCL data plane (the cuda preset with libnccl).
bool HaveNcclDataPlane();

// Null for the CPU backend; the NCCL factory for CUDA on `device`. UNIMPLEMENTED for a backend
// without a tensor-parallel transport (CUDA in a build without NCCL).
absl::StatusOr<std::unique_ptr<TpDataPlaneFactory>> TpDataPlaneFor(const kernels::Backend& backend, int device,
                                                                   absl::Duration collective_timeout);

}  // namespace nq::worker
