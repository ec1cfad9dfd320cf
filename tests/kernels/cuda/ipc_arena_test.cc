// CUDA IPC slot arenas across two processes (DESIGN.md section 4): the parent plays the
// worker (allocates and exports the arena), a forked child plays the streamer (opens it and
// writes a record). Its own binary: the child must fork before this process touches CUDA.
#include "kernels/cuda/ipc_arena.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace nq::kernels::cuda {
namespace {

constexpr uint64_t kArenaBytes = 1 << 20;
constexpr uint64_t kOffset = 3 * 4096;
constexpr size_t kRecordBytes = 8192;

std::byte Pattern(size_t i) { return static_cast<std::byte>((i * 131 + 7) & 0xff); }

// The streamer: reads the handle, opens the arena, copies the record from pinned memory.
int ChildWrites(int from_parent, int to_parent) {
  IpcArenaHandle handle;
  if (read(from_parent, &handle, sizeof(handle)) != sizeof(handle)) return 10;
  absl::StatusOr<std::unique_ptr<IpcArenaMapping>> mapping = IpcArenaMapping::Open(handle);
  if (!mapping.ok()) {
    std::fprintf(stderr, "child: %s\n", mapping.status().ToString().c_str());
    return 11;
  }
  std::vector<std::byte> record(kRecordBytes);
  for (size_t i = 0; i < record.size(); ++i) record[i] = Pattern(i);
  if (!PinHostMemory(record).ok()) return 12;
  absl::Status written = (*mapping)->Write(kOffset, record);
  if (!written.ok()) {
    std::fprintf(stderr, "child: %s\n", written.ToString().c_str());
    return 13;
  }
  if ((*mapping)->Write(kArenaBytes - 10, std::span<const std::byte>(record).first(11)).code() !=
      absl::StatusCode::kOutOfRange) {
    return 14;
  }
  if (!UnpinHostMemory(record).ok()) return 15;
  const char done = 1;
  if (write(to_parent, &done, 1) != 1) return 16;
  return 0;
}

TEST(IpcArenaTest, AnotherProcessWritesIntoTheArenaAndTheCopyIsCompleteBeforeItSaysSo) {
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(ChildWrites(to_child[0], to_parent[1]));

  absl::StatusOr<std::unique_ptr<DeviceArena>> arena = DeviceArena::Allocate(0, kArenaBytes);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const IpcArenaHandle& handle = (*arena)->handle();
  ASSERT_EQ(write(to_child[1], &handle, sizeof(handle)), static_cast<ssize_t>(sizeof(handle)));
  char done = 0;
  ASSERT_EQ(read(to_parent[0], &done, 1), 1) << "the child failed before writing";
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);

  // The worker orders its stream after the streamer's copy, then reads the arena.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_TRUE((*arena)->OrderAfterLoads(stream).ok());
  std::vector<std::byte> host(kArenaBytes);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), (*arena)->data(), kArenaBytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  for (size_t i = 0; i < kRecordBytes; ++i) ASSERT_EQ(host[kOffset + i], Pattern(i)) << i;
  for (size_t i = 0; i < kOffset; ++i) ASSERT_EQ(host[i], std::byte{0}) << "written outside the slot at " << i;
  for (size_t i = kOffset + kRecordBytes; i < kArenaBytes; ++i) ASSERT_EQ(host[i], std::byte{0}) << i;
}

TEST(IpcArenaTest, AnUnknownDeviceIsNotFound) {
  IpcArenaHandle handle;
  handle.device_uuid.fill('\x7f');
  EXPECT_EQ(IpcArenaMapping::Open(handle).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace nq::kernels::cuda
