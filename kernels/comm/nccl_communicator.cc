#include "kernels/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace nq::kernels {
namespace {

static_assert(NCCL_UNIQUE_ID_BYTES == kNcclUniqueIdBytes);

absl::Status NcclError(const char* what, ncclResult_t result) {
  const std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result));
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return absl::InvalidArgumentError(message);
    case ncclSystemError:
    case ncclRemoteError: return absl::UnavailableError(message);
    default: return absl::InternalError(message);
  }
}

#define NQ_NCCL_RETURN_IF_ERROR(call)                                   \
  do {                                                                  \
    ncclResult_t nq_nccl_result_ = (call);                              \
    if (nq_nccl_result_ != ncclSuccess) return NcclError(#call, nq_nccl_result_); \
  } while (false)

absl::Status CheckF32(const char* op, const Tensor& t) {
  if (!t.valid() || t.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": want an F32 tensor, got ", t.DebugString()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<NcclUniqueId> NewNcclUniqueId() {
  ncclUniqueId id;
  NQ_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(const NcclUniqueId& id, int rank,
                                                                           int world_size, int device,
                                                                           void* stream) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL rank ", rank, " of world ", world_size));
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
  }
  ncclUniqueId nccl_id;
  std::memcpy(nccl_id.internal, id.data(), id.size());
  ncclComm_t comm = nullptr;
  NQ_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm, world_size, nccl_id, rank));
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(comm, stream, rank, world_size));
}

NcclCommunicator::~NcclCommunicator() {
  // Errors cannot be reported from a destructor; the communicator is gone either way.
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

absl::Status NcclCommunicator::AllReduceSum(Tensor& data) {
  if (absl::Status s = CheckF32("AllReduceSum", data); !s.ok()) return s;
  NQ_NCCL_RETURN_IF_ERROR(ncclAllReduce(data.data(), data.data(), static_cast<size_t>(data.NumElements()),
                                        ncclFloat32, ncclSum, static_cast<ncclComm_t>(comm_),
                                        static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllGather(const Tensor& in, Tensor& out) {
  if (absl::Status s = CheckF32("AllGather", in); !s.ok()) return s;
  if (absl::Status s = CheckF32("AllGather", out); !s.ok()) return s;
  if (out.NumElements() != in.NumElements() * world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("AllGather: out has ", out.NumElements(),
                                                   " elements, want ", in.NumElements() * world_size_));
  }
  NQ_NCCL_RETURN_IF_ERROR(ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.NumElements()),
                                        ncclFloat32, static_cast<ncclComm_t>(comm_),
                                        static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Broadcast(Tensor& data, int root) {
  if (absl::Status s = CheckF32("Broadcast", data); !s.ok()) return s;
  if (root < 0 || root >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " out of range"));
  }
  NQ_NCCL_RETURN_IF_ERROR(ncclBroadcast(data.data(), data.data(), static_cast<size_t>(data.NumElements()),
                                        ncclFloat32, root, static_cast<ncclComm_t>(comm_),
                                        static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

}  // namespace nq::kernels
