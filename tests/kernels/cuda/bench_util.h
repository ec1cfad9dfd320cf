// What the GPU benchmarks (nq_moe_bench, mla_decode_bench, gemv_bench) share: exit-on-error
// checks, graph-replay timing, and the device-to-device copy bandwidth every figure is set against. Measurements, not tests: a
// failure ends the program with the failing call printed.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"

#define BENCH_CHECK(expr)                                                             \
  do {                                                                                \
    const cudaError_t e_ = (expr);                                                    \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));                \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#define BENCH_OK(expr)                                                                \
  do {                                                                                \
    const absl::Status s_ = (expr);                                                   \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s: %s\n", #expr, std::string(s_.message()).c_str());    \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace nq::bench {

// Device memory for the length of a scope.
struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(std::size_t n) { BENCH_CHECK(cudaMalloc(&p, n)); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// Bytes per second of a 2 GiB cudaMemcpyAsync device to device, read + write counted.
inline double CopyBandwidth() {
  constexpr std::size_t kBytes = std::size_t{2} << 30;
  DeviceBytes a(kBytes), b(kBytes);
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  BENCH_CHECK(cudaMemcpy(b.p, a.p, kBytes, cudaMemcpyDeviceToDevice));
  constexpr int kIters = 10;
  BENCH_CHECK(cudaEventRecord(start));
  for (int i = 0; i < kIters; ++i) BENCH_CHECK(cudaMemcpyAsync(b.p, a.p, kBytes, cudaMemcpyDeviceToDevice));
  BENCH_CHECK(cudaEventRecord(stop));
  BENCH_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  return 2.0 * kBytes * kIters / (ms * 1e-3);
}

// The current device's SM count, a non-blocking stream, and the copy bandwidth, printed as the
// first line of a benchmark's output (every figure after it is set against that bandwidth).
struct BenchDevice {
  int num_sms = 0;
  cudaStream_t stream = nullptr;
  double copy_bw = 0;  // bytes per second, read + write (CopyBandwidth)
};
inline BenchDevice OpenBenchDevice() {
  BenchDevice d;
  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  BENCH_CHECK(cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, device));
  BENCH_CHECK(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
  d.copy_bw = CopyBandwidth();
  std::printf("device-to-device copy: %.2f TB/s (read + write); %d SMs\n", d.copy_bw / 1e12, d.num_sms);
  return d;
}

// Microseconds per replay of what `issue()` enqueues on `stream`, captured once as a CUDA graph:
// one replay to warm up, then `replays` timed back to back.
template <typename Issue>
double GraphReplayMicros(cudaStream_t stream, int replays, Issue&& issue) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  issue();
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  BENCH_CHECK(cudaGraphDestroy(graph));
  BENCH_CHECK(cudaGraphLaunch(exec, stream));
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  BENCH_CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < replays; ++r) BENCH_CHECK(cudaGraphLaunch(exec, stream));
  BENCH_CHECK(cudaEventRecord(stop, stream));
  BENCH_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  return 1e3 * ms / replays;
}

}  // namespace nq::bench
