// The one place absl::Status becomes grpc::Status and back (STYLE.md 7).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace nq {

// Canonical codes map one to one (absl and gRPC share the numbering).
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace nq
