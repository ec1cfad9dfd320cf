#include "bench/streamer/bench_arena.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

#ifdef NQ_HAVE_CUDA
#include "kernels/cuda/ipc_arena.h"
#endif

namespace nq::streamer::bench {
namespace {

#ifdef NQ_HAVE_CUDA
// Reads exactly `n` bytes from `fd`.
bool ReadAll(int fd, void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// The forked worker: allocates the device arena, sends its handle up `to_parent`, and keeps
// the arena alive until the parent closes `from_parent`. Never returns.
[[noreturn]] void RunDeviceWorker(uint64_t bytes, int to_parent, int from_parent) {
  absl::StatusOr<std::unique_ptr<kernels::cuda::DeviceArena>> arena = kernels::cuda::DeviceArena::Allocate(0, bytes);
  kernels::cuda::IpcArenaHandle handle;
  const bool ok = arena.ok();
  if (ok) handle = (*arena)->handle();
  if (::write(to_parent, &ok, 1) != 1 || (ok && ::write(to_parent, &handle, sizeof(handle)) != sizeof(handle))) {
    _exit(2);
  }
  char byte;
  while (::read(from_parent, &byte, 1) < 0 && errno == EINTR) {
  }
  _exit(ok ? 0 : 1);
}
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<BenchArena>> BenchArena::Create(const std::string& kind, uint64_t bytes) {
  std::unique_ptr<BenchArena> arena(new BenchArena());
  nq::v1::RegisterWorkerRequest request;
  if (kind == "shm") {
    ASSIGN_OR_RETURN(SharedMemory shm, SharedMemory::Create(absl::StrCat("/nq-bench-arena-", ::getpid()), bytes));
    request.mutable_shm()->set_name(shm.name());
    request.mutable_shm()->set_bytes(shm.size());
    arena->shm_.emplace(std::move(shm));
  } else if (kind == "cuda_ipc") {
#ifdef NQ_HAVE_CUDA
    int up[2], down[2];
    if (::pipe(up) != 0 || ::pipe(down) != 0) return absl::InternalError("pipe");
    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      ::close(up[0]);
      ::close(down[1]);
      RunDeviceWorker(bytes, up[1], down[0]);
    }
    ::close(up[1]);
    ::close(down[0]);
    arena->worker_pid_ = pid;
    arena->worker_pipe_ = down[1];
    bool ok = false;
    kernels::cuda::IpcArenaHandle handle;
    const bool got = ReadAll(up[0], &ok, 1) && ok && ReadAll(up[0], &handle, sizeof(handle));
    ::close(up[0]);
    if (!got) return absl::FailedPreconditionError("the device worker could not allocate its arena");
    nq::v1::CudaIpcArena* ipc = request.mutable_cuda_ipc();
    ipc->set_mem_handle(handle.memory.data(), handle.memory.size());
    ipc->set_event_handle(handle.event.data(), handle.event.size());
    ipc->set_device_uuid(handle.device_uuid.data(), handle.device_uuid.size());
    ipc->set_bytes(handle.bytes);
#else
    return absl::UnimplementedError("--arena=cuda_ipc needs a build with CUDA (cmake --preset cuda)");
#endif
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--arena=", kind, ": want shm or cuda_ipc"));
  }
  ASSIGN_OR_RETURN(arena->writer_, OpenArena(request, bytes));
  return arena;
}

BenchArena::~BenchArena() {
  writer_.reset();  // unmap before the worker frees the arena
  if (worker_pipe_ >= 0) ::close(worker_pipe_);
  if (worker_pid_ > 0) {
    int status = 0;
    while (::waitpid(worker_pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

}  // namespace nq::streamer::bench
