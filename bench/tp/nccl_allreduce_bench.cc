// NCCL all-reduce on one GPU through the worker's own path (issue #18's H200 rows; run by
// scripts/device/run_nccl_single_rank.sh, cuda preset with NCCL only):
//   1. a W = 1 data plane made as a worker rank makes it: NcclDataPlaneFactory on the CUDA
//      backend's stream, rank 0's bootstrap (a new unique id) encoded and decoded as it travels
//      over the group's control channel, and the non-blocking join;
//   2. the all-reduce inside a graph captured by the backend (Backend::BeginCapture, the decode
//      step graphs' mechanism) between two backend kernels, against the same ops run eagerly;
//   3. latency per call at hidden 6144 (GLM-5) and 7168 (DeepSeek-V3), F32 and BF16: eager
//      (enqueue, then wait for it: one call's round trip) and in a graph of 64 all-reduces (the
//      cost a captured decode step pays per collective).
// W = 1 measures NCCL's fixed cost per call on this GPU (no peer traffic); W > 1 needs GPUs this
// issue does not have.
//
//   nccl_allreduce_bench [--calls=2000] [--graph_runs=200]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "services/common/status_macros.h"
#include "services/worker/tp_bootstrap.h"
#include "services/worker/tp_nccl.h"

namespace {

using nq::kernels::Backend;
using nq::kernels::DType;
using nq::kernels::Shape;
using nq::kernels::Tensor;
using nq::worker::TpDataPlane;

constexpr int kCallsPerGraph = 64;

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);  // the test values are exact in BF16
}

absl::StatusOr<Tensor> Upload(Backend& backend, DType dtype, const std::vector<float>& values) {
  ASSIGN_OR_RETURN(Tensor t, backend.Allocate(dtype, Shape{static_cast<int64_t>(values.size())}));
  if (dtype == DType::kF32) {
    RETURN_IF_ERROR(backend.CopyFromHost(std::as_bytes(std::span<const float>(values)), t));
  } else {
    std::vector<uint16_t> half(values.size());
    for (size_t i = 0; i < values.size(); ++i) half[i] = ToBf16(values[i]);
    RETURN_IF_ERROR(backend.CopyFromHost(std::as_bytes(std::span<const uint16_t>(half)), t));
  }
  return t;
}

absl::StatusOr<std::vector<float>> DownloadF32(Backend& backend, const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.NumElements()));
  RETURN_IF_ERROR(backend.CopyToHost(t, std::as_writable_bytes(std::span<float>(out))));
  return out;
}

// The worker's join for rank 0 of a world of one, its bootstrap through the wire format.
absl::StatusOr<std::unique_ptr<TpDataPlane>> JoinAsWorker(Backend& backend) {
  ASSIGN_OR_RETURN(const nq::worker::TpDataPlaneFactory factory,
                   nq::worker::NcclDataPlaneFactory(0, nq::kernels::cuda::NativeStream(backend), absl::Seconds(60)));
  ASSIGN_OR_RETURN(const nq::kernels::NcclUniqueId id, factory.new_id());
  const nq::worker::TpBootstrap sent{.transport = factory.transport, .world_size = 1, .generation = 1,
                                     .nccl_version = factory.nccl_version, .id = id};
  ASSIGN_OR_RETURN(const nq::worker::TpBootstrap got, nq::worker::DecodeTpBootstrap(nq::worker::EncodeTpBootstrap(sent)));
  std::printf("NCCL %d; unique id %s the wire format\n", factory.nccl_version,
              got.id == id ? "intact through" : "CHANGED by");
  return factory.join(got, 0, [] { return absl::OkStatus(); });
}

// z = (x + x) all-reduced + x, eagerly and as a captured graph: both must give 3x (W = 1).
absl::Status GraphCorrectness(Backend& backend, TpDataPlane& plane) {
  const int64_t n = 7168;
  std::vector<float> xs(n);
  for (int64_t i = 0; i < n; ++i) xs[i] = static_cast<float>(i % 97) * 0.25f - 12.0f;
  ASSIGN_OR_RETURN(Tensor x, Upload(backend, DType::kF32, xs));
  ASSIGN_OR_RETURN(Tensor y, backend.Allocate(DType::kF32, Shape{n}));
  ASSIGN_OR_RETURN(Tensor z, backend.Allocate(DType::kF32, Shape{n}));
  auto enqueue = [&]() -> absl::Status {
    RETURN_IF_ERROR(backend.Add(x, x, y));
    RETURN_IF_ERROR(plane.AllReduceSum(y));
    return backend.Add(y, x, z);
  };
  RETURN_IF_ERROR(enqueue());
  ASSIGN_OR_RETURN(std::vector<float> eager, DownloadF32(backend, z));
  RETURN_IF_ERROR(backend.Add(x, x, z));  // overwrite z so the graph must write it
  RETURN_IF_ERROR(backend.BeginCapture());
  const absl::Status captured = enqueue();
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = backend.EndCapture();
  RETURN_IF_ERROR(captured);
  if (!graph.ok()) return graph.status();
  RETURN_IF_ERROR((*graph)->Run());
  ASSIGN_OR_RETURN(std::vector<float> replayed, DownloadF32(backend, z));
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += (eager[i] != 3 * xs[i]) + (replayed[i] != 3 * xs[i]);
  std::printf("all-reduce between two kernels: eager %s, in a captured graph %s (%ld wrong of %ld)\n",
              eager == replayed ? "==" : "!=", wrong == 0 ? "both exact" : "WRONG", static_cast<long>(wrong),
              static_cast<long>(2 * n));
  return wrong == 0 ? absl::OkStatus() : absl::InternalError("the all-reduce gave wrong sums");
}

absl::Status Latency(Backend& backend, TpDataPlane& plane, DType dtype, int64_t hidden, int calls, int graph_runs) {
  ASSIGN_OR_RETURN(Tensor t, Upload(backend, dtype, std::vector<float>(static_cast<size_t>(hidden), 1.0f)));
  std::vector<double> eager_us;
  for (int i = 0; i < calls + calls / 10; ++i) {
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(plane.AllReduceSum(t));
    // The stream alone: Backend::Synchronize also hands the memory pool's cache back.
    if (cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(nq::kernels::cuda::NativeStream(backend)));
        e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaStreamSynchronize: ", cudaGetErrorString(e)));
    }
    const auto end = std::chrono::steady_clock::now();
    if (i >= calls / 10) eager_us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
  }
  RETURN_IF_ERROR(backend.BeginCapture());
  absl::Status captured = absl::OkStatus();
  for (int i = 0; i < kCallsPerGraph && captured.ok(); ++i) captured = plane.AllReduceSum(t);
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = backend.EndCapture();
  RETURN_IF_ERROR(captured);
  if (!graph.ok()) return graph.status();
  std::vector<double> graph_us;  // per all-reduce, from one graph run of kCallsPerGraph
  for (int i = 0; i < graph_runs + 10; ++i) {
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR((*graph)->Run());
    const auto end = std::chrono::steady_clock::now();
    if (i >= 10) graph_us.push_back(std::chrono::duration<double, std::micro>(end - start).count() / kCallsPerGraph);
  }
  std::printf("%-6s %-7ld %-14.2f %-14.2f %-16.2f %-16.2f\n", dtype == DType::kF32 ? "fp32" : "bf16",
              static_cast<long>(hidden), Percentile(eager_us, 0.5), Percentile(eager_us, 0.99),
              Percentile(graph_us, 0.5), Percentile(graph_us, 0.99));
  return absl::OkStatus();
}

absl::Status Run(int calls, int graph_runs) {
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, nq::kernels::CreateBackend("cuda", {.device = 0}));
  std::printf("device: %s\n", backend->DeviceDescription().c_str());
  ASSIGN_OR_RETURN(std::unique_ptr<TpDataPlane> plane, JoinAsWorker(*backend));
  RETURN_IF_ERROR(GraphCorrectness(*backend, *plane));
  std::printf("%-6s %-7s %-14s %-14s %-16s %-16s\n", "dtype", "hidden", "eager_p50_us", "eager_p99_us",
              "graph_p50_us", "graph_p99_us");
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t hidden : {6144, 7168}) RETURN_IF_ERROR(Latency(*backend, *plane, dtype, hidden, calls, graph_runs));
  }
  return plane->Health();
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 2000, graph_runs = 200;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool ok = false;
    if (a.rfind("--calls=", 0) == 0) ok = absl::SimpleAtoi(a.substr(8), &calls) && calls >= 10;
    if (a.rfind("--graph_runs=", 0) == 0) ok = absl::SimpleAtoi(a.substr(13), &graph_runs) && graph_runs >= 1;
    if (!ok) {
      std::fprintf(stderr, "usage: %s [--calls=2000] [--graph_runs=200]\n", argv[0]);
      return 2;
    }
  }
  if (absl::Status s = Run(calls, graph_runs); !s.ok()) {
    std::fprintf(stderr, "nccl_allreduce_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
