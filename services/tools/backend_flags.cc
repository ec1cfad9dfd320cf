#include "services/tools/backend_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

ABSL_FLAG(std::string, backend, "cpu", "bench-decode, bench-prefill: compute backend, cpu or cuda");
ABSL_FLAG(int, gpu, 0, "bench-decode, bench-prefill: CUDA device ordinal (with --backend cuda)");
ABSL_FLAG(std::string, decode_gemv, "auto",
          "bench-decode, bench-prefill (--backend cuda): the decode GEMV of BF16 matrices, auto (the tensor "
          "cores where they pay), tensor or fma for every matrix, to measure one against the other");

namespace nq::tools {

absl::StatusOr<std::unique_ptr<kernels::Backend>> BackendFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_backend);
  const int gpu = absl::GetFlag(FLAGS_gpu);
  if (name != "cuda" && gpu != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--gpu=", gpu, " applies to --backend cuda, not ", name));
  }
  absl::StatusOr<kernels::DecodeGemv> decode_gemv = kernels::ParseDecodeGemv(absl::GetFlag(FLAGS_decode_gemv));
  if (!decode_gemv.ok()) return Annotate(decode_gemv.status(), "--decode_gemv");
  // Unknown names, cuda in a CPU-only build, a missing device and --decode_gemv on the CPU come
  // back from the factory with their reason.
  return kernels::CreateBackend(name, {.device = gpu, .cuda_decode_gemv = *decode_gemv});
}

}  // namespace nq::tools
