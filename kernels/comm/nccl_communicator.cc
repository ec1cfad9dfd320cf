#include "kernels/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace nq::kernels {
namespace {

static_assert(NCCL_UNIQUE_ID_BYTES == kNcclUniqueIdBytes);

// Polls of a join, a settling enqueue or a stream wait: spin (yield) this many times first, since
// an enqueue or a decode step's collective usually finishes within microseconds, then sleep.
constexpr int kSpinsBeforeSleep = 256;
constexpr auto kPollSleep = std::chrono::microseconds(50);
// After an abort, how long a wait gives the device to let go of the aborted operations.
constexpr absl::Duration kAfterAbortWait = absl::Seconds(10);
// A communicator being destroyed gets this long to flush (ncclCommFinalize) before it is aborted.
constexpr absl::Duration kFinalizeWait = absl::Seconds(10);

absl::Status NcclError(absl::string_view what, ncclResult_t result) {
  const std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result));
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return absl::InvalidArgumentError(message);
    case ncclSystemError:
    case ncclRemoteError: return absl::UnavailableError(message);
    default: return absl::InternalError(message);
  }
}

absl::Status CudaError(absl::string_view what, cudaError_t e) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

#define NQ_NCCL_RETURN_IF_ERROR(call)                                             \
  do {                                                                            \
    ncclResult_t nq_nccl_result_ = (call);                                        \
    if (nq_nccl_result_ != ncclSuccess) return NcclError(#call, nq_nccl_result_); \
  } while (false)

absl::StatusOr<ncclDataType_t> NcclType(const char* op, const Tensor& t, bool bf16_ok) {
  if (t.valid() && t.dtype() == DType::kF32) return ncclFloat32;
  if (t.valid() && bf16_ok && t.dtype() == DType::kBF16) return ncclBfloat16;
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": want an F32", bf16_ok ? " or BF16" : "", " tensor, got ", t.DebugString()));
}

// Polls `done` (spinning, then sleeping) until it is true or fails, `check` fails, or `deadline`.
template <typename Done, typename Check>
absl::Status Poll(Done done, Check check, absl::Time deadline, absl::string_view what) {
  for (int spin = 0;; ++spin) {
    absl::StatusOr<bool> finished = done();
    if (!finished.ok()) return finished.status();
    if (*finished) return absl::OkStatus();
    if (absl::Status s = check(); !s.ok()) return s;
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat(what, " did not finish in time"));
    if (spin < kSpinsBeforeSleep) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollSleep);
    }
  }
}

}  // namespace

absl::StatusOr<NcclUniqueId> NewNcclUniqueId() {
  ncclUniqueId id;
  NQ_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

absl::StatusOr<int> NcclVersion() {
  int version = 0;
  NQ_NCCL_RETURN_IF_ERROR(ncclGetVersion(&version));
  return version;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(const NcclUniqueId& id,
                                                                           const NcclCommunicatorOptions& options) {
  const int rank = options.rank, world = options.world_size;
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL rank ", rank, " of world ", world));
  }
  if (options.stream == nullptr) {
    return absl::InvalidArgumentError("NCCL communicator: no stream (the collectives must order with the backend's)");
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cudaSetDevice(", options.device, "): ", cudaGetErrorString(e)));
  }
  cudaEvent_t event = nullptr;
  if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); e != cudaSuccess) {
    return CudaError("cudaEventCreateWithFlags", e);
  }
  auto destroy_event = [&] { (void)cudaEventDestroy(event); };  // a failed join reports the join's error
  ncclUniqueId nccl_id;
  std::memcpy(nccl_id.internal, id.data(), id.size());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, world, nccl_id, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    destroy_event();
    return NcclError(absl::StrCat("ncclCommInitRank (rank ", rank, " of ", world, ")"), started);
  }
  const absl::Status joined = Poll(
      [&]() -> absl::StatusOr<bool> {
        ncclResult_t state = ncclSuccess;
        if (ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) {
          return NcclError("ncclCommGetAsyncError", r);
        }
        if (state == ncclInProgress) return false;
        if (state != ncclSuccess) return NcclError(absl::StrCat("ncclCommInitRank (rank ", rank, " of ", world, ")"), state);
        return true;
      },
      [&] { return options.peers_alive ? options.peers_alive() : absl::OkStatus(); },
      absl::Now() + options.join_timeout, absl::StrCat("joining the NCCL world of ", world, " as rank ", rank));
  if (!joined.ok()) {
    (void)ncclCommAbort(comm);  // the join's status is what the caller needs
    destroy_event();
    return joined;
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(comm, event, options));
}

NcclCommunicator::~NcclCommunicator() {
  // Destructors report nothing. A healthy communicator is flushed and destroyed; one that is
  // failed, or does not flush in time (a peer gone), is aborted, which never waits for peers.
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ != nullptr) {
    ncclComm_t comm = static_cast<ncclComm_t>(comm_);
    // Non-blocking: the flush answers "in progress" and is polled to its end.
    const ncclResult_t finalize = HealthLocked().ok() ? ncclCommFinalize(comm) : ncclInternalError;
    bool flushed = finalize == ncclSuccess || finalize == ncclInProgress;
    const absl::Time deadline = absl::Now() + kFinalizeWait;
    ncclResult_t state = ncclInProgress;
    while (flushed && state == ncclInProgress) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess || absl::Now() > deadline) flushed = false;
      if (state == ncclInProgress) std::this_thread::sleep_for(kPollSleep);
    }
    if (flushed && state == ncclSuccess) {
      (void)ncclCommDestroy(comm);
    } else {
      (void)ncclCommAbort(comm);
    }
    comm_ = nullptr;
  }
  if (event_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

absl::Status NcclCommunicator::HealthLocked() {
  if (comm_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("NCCL communicator aborted: ", aborted_));
  }
  ncclResult_t state = ncclSuccess;
  NQ_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_), &state));
  if (state != ncclSuccess && state != ncclInProgress) return NcclError("NCCL asynchronous error", state);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Health() {
  std::lock_guard<std::mutex> lock(mu_);
  return HealthLocked();
}

void NcclCommunicator::AbortLocked(absl::string_view reason) {
  if (comm_ == nullptr) return;
  aborted_ = std::string(reason);
  (void)ncclCommAbort(static_cast<ncclComm_t>(comm_));  // nothing more to do if it fails: the comm is gone
  comm_ = nullptr;
}

void NcclCommunicator::Abort(absl::string_view reason) {
  std::lock_guard<std::mutex> lock(mu_);
  AbortLocked(reason);
}

absl::Status NcclCommunicator::Settle(const char* what, int result) {
  const ncclResult_t r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess) return absl::OkStatus();
  if (r != ncclInProgress) return NcclError(what, r);
  // A non-blocking communicator answers "in progress" whenever it hands the launch to a thread of
  // its own (every call with W > 1), and it must be done before the next call. That launch can
  // wait for the peers: NCCL connects lazily (NCCL_RUNTIME_CONNECT, on by default since 2.22), at
  // the first call of each algorithm, which every rank must reach. So it is bounded and watched
  // like a join, and one that fails or does not end aborts the communicator: left "in progress",
  // every later call would fail (ncclCommEnsureReady: invalid argument) while HealthLocked, which
  // takes "in progress" for healthy, kept reporting OK, and the group would never re-form.
  const absl::Status settled = Poll(
      [&]() -> absl::StatusOr<bool> {
        ncclResult_t state = ncclSuccess;
        NQ_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_), &state));
        if (state == ncclInProgress) return false;
        if (state != ncclSuccess) return NcclError(what, state);
        return true;
      },
      [&] { return options_.peers_alive ? options_.peers_alive() : absl::OkStatus(); },
      absl::Now() + options_.join_timeout, what);
  if (!settled.ok()) AbortLocked(absl::StrCat(what, ": ", settled.message()));
  return settled;
}

absl::Status NcclCommunicator::AllReduceSum(Tensor& data) {
  absl::StatusOr<ncclDataType_t> type = NcclType("AllReduceSum", data, /*bf16_ok=*/true);
  if (!type.ok()) return type.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = HealthLocked(); !s.ok()) return s;
  return Settle("ncclAllReduce",
                ncclAllReduce(data.data(), data.data(), static_cast<size_t>(data.NumElements()), *type, ncclSum,
                              static_cast<ncclComm_t>(comm_), static_cast<cudaStream_t>(options_.stream)));
}

absl::Status NcclCommunicator::AllGather(const Tensor& in, Tensor& out) {
  absl::StatusOr<ncclDataType_t> type = NcclType("AllGather", in, /*bf16_ok=*/true);
  if (!type.ok()) return type.status();
  if (!out.valid() || out.dtype() != in.dtype() || out.NumElements() != in.NumElements() * world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("AllGather: out is ", out.DebugString(), ", want ",
                                                   in.NumElements() * world_size(), " elements of in's dtype"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = HealthLocked(); !s.ok()) return s;
  return Settle("ncclAllGather",
                ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.NumElements()), *type,
                              static_cast<ncclComm_t>(comm_), static_cast<cudaStream_t>(options_.stream)));
}

absl::Status NcclCommunicator::Broadcast(Tensor& data, int root) {
  absl::StatusOr<ncclDataType_t> type = NcclType("Broadcast", data, /*bf16_ok=*/true);
  if (!type.ok()) return type.status();
  if (root < 0 || root >= world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " out of range"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = HealthLocked(); !s.ok()) return s;
  return Settle("ncclBroadcast",
                ncclBroadcast(data.data(), data.data(), static_cast<size_t>(data.NumElements()), *type, root,
                              static_cast<ncclComm_t>(comm_), static_cast<cudaStream_t>(options_.stream)));
}

absl::Status NcclCommunicator::WaitForStream(absl::Duration timeout) {
  cudaStream_t stream = static_cast<cudaStream_t>(options_.stream);
  cudaEvent_t event = static_cast<cudaEvent_t>(event_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t e = cudaStreamIsCapturing(stream, &capture); e != cudaSuccess) {
    return CudaError("cudaStreamIsCapturing", e);
  }
  if (capture != cudaStreamCaptureStatusNone) return absl::OkStatus();
  if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) return CudaError("cudaEventRecord", e);
  auto event_done = [&]() -> absl::StatusOr<bool> {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) return CudaError("cudaEventQuery", e);
    return true;
  };
  const absl::Status waited = Poll(
      event_done,
      [&] {
        absl::Status s = Health();
        if (s.ok() && options_.peers_alive) s = options_.peers_alive();
        return s;
      },
      absl::Now() + timeout, absl::StrCat("rank ", rank(), ": a collective of ", world_size(), " ranks"));
  if (waited.ok()) return Health();  // aborted just as the work finished: its results are suspect
  Abort(waited.message());
  // The aborted operations end on the device; wait for them so nothing still writes the buffers
  // the caller frees or reuses next.
  (void)Poll(event_done, [] { return absl::OkStatus(); }, absl::Now() + kAfterAbortWait, "the aborted collectives");
  return waited.code() == absl::StatusCode::kDeadlineExceeded ? waited : absl::UnavailableError(waited.message());
}

}  // namespace nq::kernels
