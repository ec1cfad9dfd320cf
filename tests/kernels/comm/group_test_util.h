// What the communicator tests between real processes share (shm_communicator_test.cc,
// tcp_communicator_test.cc): forking ranks, reaping them, a one-shot pipe signal, and every
// collective on one rank checked against the rank-order sum.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "kernels/comm/group_control.h"

namespace nq::kernels::testing {

// Runs `body` in a child process; its return value is the child's exit code. The child never
// returns into the test (it _exits), so it never touches the parent's objects' destructors.
inline pid_t Fork(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 99;
    code = body();
    std::fflush(stderr);
    _exit(code);
  }
  return pid;
}

// The child's exit code, or 128 + signal.
inline int Reap(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// One-shot signal between the test and a child: "the group formed", "I joined".
class Pipe {
 public:
  Pipe() { EXPECT_EQ(pipe(fds_), 0); }
  ~Pipe() {
    close(fds_[0]);
    close(fds_[1]);
  }
  void Signal() { EXPECT_EQ(write(fds_[1], "x", 1), 1); }
  bool Wait() {
    char byte;
    return read(fds_[0], &byte, 1) == 1;
  }

 private:
  int fds_[2] = {-1, -1};
};

inline Tensor F32(Backend& backend, int64_t n) { return *backend.Allocate(DType::kF32, Shape{n}); }

// The value rank r contributes at element i: not exactly representable sums, so the order of
// the additions shows in the bits.
inline float Value(int r, int64_t i) { return 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i) / 7.0f; }

// Every collective on one rank, checked against the rank-order sum; 0 when all match.
inline int RunCollectives(GroupControl& comm) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  if (!backend.ok()) return 10;
  const int W = comm.world_size();
  const int64_t n = 1000;
  Tensor t = F32(**backend, n);
  for (int64_t i = 0; i < n; ++i) t.data_as<float>()[i] = Value(comm.rank(), i);
  if (!comm.AllReduceSum(t).ok()) return 11;
  for (int64_t i = 0; i < n; ++i) {
    float want = 0.0f;
    for (int r = 0; r < W; ++r) want += Value(r, i);
    if (t.data_as<float>()[i] != want) {
      std::fprintf(stderr, "rank %d: sum[%ld] = %.9g, want %.9g\n", comm.rank(), static_cast<long>(i),
                   t.data_as<float>()[i], want);
      return 12;
    }
  }
  Tensor in = F32(**backend, n);
  Tensor out = F32(**backend, n * W);
  for (int64_t i = 0; i < n; ++i) in.data_as<float>()[i] = Value(comm.rank(), i);
  if (!comm.AllGather(in, out).ok()) return 13;
  for (int r = 0; r < W; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      if (out.data_as<float>()[r * n + i] != Value(r, i)) return 14;
    }
  }
  for (int root : {0, W - 1}) {
    for (int64_t i = 0; i < n; ++i) t.data_as<float>()[i] = Value(comm.rank(), i);
    if (!comm.Broadcast(t, root).ok()) return 15;
    for (int64_t i = 0; i < n; ++i) {
      if (t.data_as<float>()[i] != Value(root, i)) return 16;
    }
  }
  std::vector<std::byte> none;  // a command without payload still crosses
  if (!comm.BroadcastBytes(none, 0, absl::Seconds(30)).ok()) return 17;
  return 0;
}

}  // namespace nq::kernels::testing
