// --backend, --gpu and --decode_gemv of the nq commands that run a model as nq-worker does (bench-decode,
// bench-prefill), and the backend they name.
#pragma once

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int, gpu);
ABSL_DECLARE_FLAG(std::string, decode_gemv);

namespace nq::tools {

// The backend --backend names on device --gpu. INVALID_ARGUMENT for --gpu with a backend other
// than cuda or an unknown name, UNIMPLEMENTED for cuda in a CPU-only build, FAILED_PRECONDITION
// for a missing or unusable device.
absl::StatusOr<std::unique_ptr<kernels::Backend>> BackendFromFlags();

}  // namespace nq::tools
