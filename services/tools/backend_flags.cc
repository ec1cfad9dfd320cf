#include "services/tools/backend_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, backend, "cpu", "bench-decode, bench-prefill: compute backend, cpu or cuda");
ABSL_FLAG(int, gpu, 0, "bench-decode, bench-prefill: CUDA device ordinal (with --backend cuda)");

namespace nq::tools {

absl::StatusOr<std::unique_ptr<kernels::Backend>> BackendFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_backend);
  const int gpu = absl::GetFlag(FLAGS_gpu);
  if (name != "cuda" && gpu != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--gpu=", gpu, " applies to --backend cuda, not ", name));
  }
  // Unknown names, cuda in a CPU-only build and a missing device come back from the factory
  // with their reason.
  return kernels::CreateBackend(name, {.device = gpu});
}

}  // namespace nq::tools
