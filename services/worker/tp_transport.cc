#include "services/worker/tp_transport.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

#if defined(NQ_HAVE_NCCL)
#include "kernels/cuda/cuda_backend.h"
#include "services/worker/tp_nccl.h"
#endif

namespace nq::worker {

bool HaveNcclDataPlane() {
#if defined(NQ_HAVE_NCCL)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<TpDataPlaneFactory>> TpDataPlaneFor(const kernels::Backend& backend, int device,
                                                                   absl::Duration collective_timeout) {
  if (backend.name() == "cpu") return nullptr;
#if defined(NQ_HAVE_NCCL)
  if (backend.name() == "cuda") {
    ASSIGN_OR_RETURN(TpDataPlaneFactory factory,
                     NcclDataPlaneFactory(device, kernels::cuda::NativeStream(backend), collective_timeout));
    return std::make_unique<TpDataPlaneFactory>(std::move(factory));
  }
#endif
  (void)device;
  (void)collective_timeout;
  return absl::UnimplementedError(absl::StrCat("tensor parallelism on the ", std::string(backend.name()),
                                               " backend needs NCCL, and this nq-worker was built without it"));
}

}  // namespace nq::worker
