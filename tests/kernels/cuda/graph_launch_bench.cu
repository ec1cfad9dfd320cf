// What a CUDA graph's launch costs the host and the GPU, by what the graph holds (bench/README.md,
// "The decode step as it runs"): a measurement, not a test.
//
//   graph_launch_bench [--kernels N] [--replays R]
//
// Traced with CUPTI, the GLM-5 slice's graphed step spent ~80 us between replays, ~55 us of it
// inside cudaGraphLaunch; this showed that to be the tracer's cost (2-6 us without it). The step's
// graph holds ~120 kernels with programmatic-dependent edges, a side stream forked and joined per
// layer, the stream-ordered allocator's alloc and free nodes, and copies to pinned host memory
// (copy nodes, or kernels storing into it, as the backend makes the small ones). This builds
// graphs of N tiny kernels with each of those features alone and together, and reports per
// replay the host's time in cudaGraphLaunch and the time from the launch to the synchronize's
// return, so each feature's launch cost can be read off.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/mapped_host_copy.cuh"
#include "tests/kernels/cuda/bench_util.h"  // BENCH_CHECK

namespace {

enum Feature : unsigned {
  kProgrammatic = 1,  // every kernel a programmatic dependent of the one before
  kAllocations = 2,   // a stream-ordered allocation before each kernel, freed after it
  kSideStream = 4,    // every 8th kernel forks two kernels onto a side stream, joined after
  kHostCopies = 8,    // two copies to pinned host memory at the end, as the step's outputs
  kKernelHostCopies = 16,  // the same two as kernels storing into the pinned memory (the backend's
                           // DoCopyToHostAsync for small copies, mapped_host_copy.cu)
};

std::string Describe(unsigned features) {
  if (features == 0) return "plain kernels";
  std::string s;
  auto add = [&](unsigned f, const char* name) {
    if ((features & f) == 0) return;
    if (!s.empty()) s += " + ";
    s += name;
  };
  add(kProgrammatic, "programmatic");
  add(kAllocations, "alloc/free nodes");
  add(kSideStream, "side stream");
  add(kHostCopies, "host copies");
  add(kKernelHostCopies, "host copies by kernels");
  return s;
}

// A few microseconds of one block per SM: the step's small kernels (norms, routing).
__global__ void TinyKernel(float* data, int n, bool programmatic) {
  if (programmatic) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (programmatic) asm volatile("griddepcontrol.launch_dependents;");
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) data[i] = data[i] * 0.5f + 1.0f;
}

// cudaLaunchKernelEx of `kernel`, a programmatic dependent of the kernel before it if asked.
template <typename... Params, typename... Args>
void LaunchEx(void (*kernel)(Params...), dim3 grid, dim3 block, bool programmatic, cudaStream_t stream,
              Args... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  config.attrs = programmatic ? &attribute : nullptr;
  config.numAttrs = programmatic ? 1 : 0;
  BENCH_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

// The backend's own small host copy (mapped_host_copy.cu), so the bench times the kernel a step runs.
void LaunchHostStore(const void* src, void* dst, int bytes, cudaStream_t stream) {
  const absl::Status launched = nq::kernels::cuda::LaunchMappedHostCopy(
      src, dst, static_cast<std::size_t>(bytes), nq::kernels::cuda::LaunchContext{.stream = stream});
  if (!launched.ok()) {
    std::fprintf(stderr, "%s\n", launched.ToString().c_str());
    std::exit(1);
  }
}

void Launch(float* data, int n, bool programmatic, cudaStream_t stream) {
  LaunchEx(TinyKernel, dim3(132), dim3(128), programmatic, stream, data, n, programmatic);
}

struct Result {
  double launch_us, replay_us;
  size_t nodes;
};

Result Measure(unsigned features, int kernels, int replays, float* data, int n, void* host_out) {
  cudaStream_t stream, side;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BENCH_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  BENCH_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  BENCH_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  const bool programmatic = (features & kProgrammatic) != 0;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < kernels; ++k) {
    float* target = data;
    void* scratch = nullptr;
    if ((features & kAllocations) != 0) {
      BENCH_CHECK(cudaMallocAsync(&scratch, 64 << 10, stream));
      target = static_cast<float*>(scratch);
    }
    Launch(target, (features & kAllocations) != 0 ? (64 << 10) / 4 : n, programmatic, stream);
    if ((features & kSideStream) != 0 && k % 8 == 0) {
      BENCH_CHECK(cudaEventRecord(fork, stream));
      BENCH_CHECK(cudaStreamWaitEvent(side, fork, 0));
      Launch(data + n, n, false, side);
      Launch(data + n, n, false, side);
      BENCH_CHECK(cudaEventRecord(join, side));
      BENCH_CHECK(cudaStreamWaitEvent(stream, join, 0));
    }
    if (scratch != nullptr) BENCH_CHECK(cudaFreeAsync(scratch, stream));
  }
  if ((features & kHostCopies) != 0) {
    BENCH_CHECK(cudaMemcpyAsync(host_out, data, 4, cudaMemcpyDeviceToHost, stream));
    BENCH_CHECK(cudaMemcpyAsync(static_cast<char*>(host_out) + 4096, data, 24576, cudaMemcpyDeviceToHost, stream));
  }
  if ((features & kKernelHostCopies) != 0) {
    LaunchHostStore(data, host_out, 16, stream);
    LaunchHostStore(data, static_cast<char*>(host_out) + 4096, 24576, stream);
  }
  cudaGraph_t graph;
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  size_t nodes = 0;
  BENCH_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  BENCH_CHECK(cudaGraphUpload(exec, stream));
  using Clock = std::chrono::steady_clock;
  auto us = [](Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); };
  for (int i = 0; i < 10; ++i) BENCH_CHECK(cudaGraphLaunch(exec, stream));
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> launch, replay;
  for (int i = 0; i < replays; ++i) {
    const Clock::time_point t0 = Clock::now();
    BENCH_CHECK(cudaGraphLaunch(exec, stream));
    const Clock::time_point t1 = Clock::now();
    BENCH_CHECK(cudaStreamSynchronize(stream));
    const Clock::time_point t2 = Clock::now();
    launch.push_back(us(t1 - t0));
    replay.push_back(us(t2 - t0));
  }
  std::sort(launch.begin(), launch.end());
  std::sort(replay.begin(), replay.end());
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  BENCH_CHECK(cudaEventDestroy(fork));
  BENCH_CHECK(cudaEventDestroy(join));
  BENCH_CHECK(cudaStreamDestroy(side));
  BENCH_CHECK(cudaStreamDestroy(stream));
  return {launch[launch.size() / 2], replay[replay.size() / 2], nodes};
}

}  // namespace

int main(int argc, char** argv) {
  int kernels = 120, replays = 200;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--kernels=", 10) == 0) kernels = std::atoi(argv[i] + 10);
    if (std::strncmp(argv[i], "--replays=", 10) == 0) replays = std::atoi(argv[i] + 10);
  }
  if (kernels < 1 || replays < 1) {
    std::fprintf(stderr, "usage: graph_launch_bench [--kernels=N>0] [--replays=R>0]\n");
    return 2;
  }
  const int n = 1 << 14;
  float* data = nullptr;
  BENCH_CHECK(cudaMalloc(&data, 2 * n * sizeof(float)));
  BENCH_CHECK(cudaMemset(data, 0, 2 * n * sizeof(float)));
  void* host_out = nullptr;
  BENCH_CHECK(cudaHostAlloc(&host_out, 32 << 10, cudaHostAllocDefault));
  // The device pool keeps what graphs free, as the backend's does.
  cudaMemPool_t pool;
  BENCH_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t threshold = UINT64_MAX;
  BENCH_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  cudaDeviceProp props;
  BENCH_CHECK(cudaGetDeviceProperties(&props, 0));
  std::printf("graph_launch_bench on %s: median of %d replays; us in cudaGraphLaunch, us launch to synchronized\n",
              props.name, replays);
  for (int count : {kernels / 4, kernels, kernels * 2}) {
    for (unsigned features : {0u, 1u, 2u, 4u, 8u, 16u, 15u, 23u, 13u, 21u}) {
      const Result r = Measure(features, count, replays, data, n, host_out);
      std::printf("%4d kernels %4zu nodes  %-60s launch %7.1f  replay %7.1f\n", count, r.nodes,
                  Describe(features).c_str(), r.launch_us, r.replay_us);
    }
  }
  BENCH_CHECK(cudaFreeHost(host_out));
  BENCH_CHECK(cudaFree(data));
  return 0;
}
