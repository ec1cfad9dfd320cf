// A kernel timeline without Nsight Systems (the GPU image has ncu but not nsys): a CUDA
// injection library that records every kernel's start and end through CUPTI's concurrent-kernel
// activity, graph replays included, and writes them as CSV when the process exits.
//
//   CUDA_INJECTION64_PATH=/path/libnq_kernel_trace.so NQ_KERNEL_TRACE=/tmp/trace.csv nq bench-decode ...
//   python3 scripts/device/kernel_trace_table.py /tmp/trace.csv
//
// Unlike ncu, which runs one kernel at a time, this keeps the step's concurrency (side streams,
// programmatic dependent launches), so the table shows where a step's time goes as it runs.
// Columns: start_ns, end_ns, stream, correlation (a graph's kernels share their launch's),
// graph_id, graph_node, grid, block, name (demangled, parameters dropped).
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

struct KernelRecord {
  uint64_t start, end;
  uint32_t stream, correlation, graph_id;
  uint64_t graph_node;
  int grid[3], block[3];
  std::string name;
};

std::mutex mutex;
std::vector<KernelRecord>* records = nullptr;  // leaked: written at exit, after statics may be gone
bool reported_drop = false;

// The name without its parameter list (templates kept), demangled where it can be.
std::string ShortName(const char* mangled) {
  if (mangled == nullptr) return "?";
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : mangled;
  std::free(demangled);
  // Kernels in anonymous namespaces: the marker's parenthesis is not a parameter list.
  for (size_t at; (at = name.find("(anonymous namespace)::")) != std::string::npos;) {
    name.erase(at, sizeof("(anonymous namespace)::") - 1);
  }
  int depth = 0;  // cut at the first '(' outside template brackets
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0 && i > 0) return name.substr(0, i);
  }
  return name;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    records->push_back({k->start, k->end, k->streamId, k->correlationId, k->graphId, k->graphNodeId,
                        {k->gridX, k->gridY, k->gridZ}, {k->blockX, k->blockY, k->blockZ}, ShortName(k->name)});
  }
  size_t dropped = 0;
  if (!reported_drop && cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped > 0) {
    std::fprintf(stderr, "nq_kernel_trace: CUPTI dropped %zu records\n", dropped);
    reported_drop = true;
  }
  std::free(buffer);
}

void WriteTrace() {
  if (cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "nq_kernel_trace: flushing CUPTI's buffers failed\n");
  }
  const char* path = std::getenv("NQ_KERNEL_TRACE");
  if (path == nullptr) path = "nq_kernel_trace.csv";
  std::lock_guard<std::mutex> lock(mutex);
  FILE* out = std::fopen(path, "w");
  if (out == nullptr) {
    std::fprintf(stderr, "nq_kernel_trace: cannot write %s\n", path);
    return;
  }
  std::fprintf(out, "start_ns,end_ns,stream,correlation,graph_id,graph_node,grid,block,name\n");
  for (const KernelRecord& r : *records) {
    std::string name = r.name;
    for (char& c : name) {
      if (c == '"') c = '\'';
    }
    std::fprintf(out, "%llu,%llu,%u,%u,%u,%llu,%dx%dx%d,%dx%dx%d,\"%s\"\n", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.stream, r.correlation, r.graph_id,
                 static_cast<unsigned long long>(r.graph_node), r.grid[0], r.grid[1], r.grid[2], r.block[0],
                 r.block[1], r.block[2], name.c_str());
  }
  const bool failed = std::fclose(out) != 0;
  std::fprintf(stderr, "nq_kernel_trace: %zu kernels %s %s\n", records->size(), failed ? "NOT fully written to" : "in",
               path);
}

}  // namespace

// Called by the CUDA driver at initialisation when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  records = new std::vector<KernelRecord>();
  records->reserve(1 << 16);
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "nq_kernel_trace: CUPTI activity tracing could not start\n");
    return 0;
  }
  std::atexit(WriteTrace);
  return 1;
}
