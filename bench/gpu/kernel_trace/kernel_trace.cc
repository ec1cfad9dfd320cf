// A kernel timeline without Nsight Systems (the GPU image has ncu but not nsys): a CUDA
// injection library that records every kernel's start and end through CUPTI's concurrent-kernel
// activity, graph replays included, and writes them as CSV when the process exits. Memory copies
// (a graph's copy nodes included) and the host's CUDA runtime calls are recorded beside them, on
// the same clock, so the time between two replays can be split into the host's calls and the
// copies (kind memcpy and api; NQ_KERNEL_TRACE_API=0 leaves the runtime calls out).
//
//   CUDA_INJECTION64_PATH=/path/libnq_kernel_trace.so NQ_KERNEL_TRACE=/tmp/trace.csv nq bench-decode ...
//   python3 scripts/device/kernel_trace_table.py /tmp/trace.csv
//
// Unlike ncu, which runs one kernel at a time, this keeps the step's concurrency (side streams,
// programmatic dependent launches), so the table shows where a step's time goes as it runs.
// Columns: start_ns, end_ns, stream, correlation (a graph's kernels share their launch's, and the
// cudaGraphLaunch call's), graph_id, graph_node, grid, block, name (a kernel's demangled,
// parameters dropped; "memcpy HtoD 4 B"; the runtime call's, e.g. cudaGraphLaunch_v10000), kind
// (kernel, memcpy, api; grid and block are empty for the last two).
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
  const char* kind;
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

const char* CopyDirection(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
    default: return "other";
  }
}

std::string RuntimeCallName(CUpti_CallbackId cbid) {
  const char* name = nullptr;
  if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, cbid, &name) != CUPTI_SUCCESS || name == nullptr) {
    return "runtime call " + std::to_string(cbid);
  }
  return name;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      records->push_back({k->start, k->end, k->streamId, k->correlationId, k->graphId, k->graphNodeId,
                          {k->gridX, k->gridY, k->gridZ}, {k->blockX, k->blockY, k->blockZ}, ShortName(k->name),
                          "kernel"});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      records->push_back({m->start, m->end, m->streamId, m->correlationId, m->graphId, m->graphNodeId, {}, {},
                          std::string("memcpy ") + CopyDirection(m->copyKind) + " " + std::to_string(m->bytes) + " B",
                          "memcpy"});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      records->push_back({a->start, a->end, 0, a->correlationId, 0, 0, {}, {}, RuntimeCallName(a->cbid), "api"});
    }
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
  std::fprintf(out, "start_ns,end_ns,stream,correlation,graph_id,graph_node,grid,block,name,kind\n");
  for (const KernelRecord& r : *records) {
    std::string name = r.name;
    for (char& c : name) {
      if (c == '"') c = '\'';
    }
    char grid[48] = "", block[48] = "";
    if (std::strcmp(r.kind, "kernel") == 0) {
      std::snprintf(grid, sizeof grid, "%dx%dx%d", r.grid[0], r.grid[1], r.grid[2]);
      std::snprintf(block, sizeof block, "%dx%dx%d", r.block[0], r.block[1], r.block[2]);
    }
    std::fprintf(out, "%llu,%llu,%u,%u,%u,%llu,%s,%s,\"%s\",%s\n", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.stream, r.correlation, r.graph_id,
                 static_cast<unsigned long long>(r.graph_node), grid, block, name.c_str(), r.kind);
  }
  const bool failed = std::fclose(out) != 0;
  std::fprintf(stderr, "nq_kernel_trace: %zu records %s %s\n", records->size(), failed ? "NOT fully written to" : "in",
               path);
}

}  // namespace

// Called by the CUDA driver at initialisation when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  records = new std::vector<KernelRecord>();
  records->reserve(1 << 16);
  const char* api = std::getenv("NQ_KERNEL_TRACE_API");
  const bool runtime_calls = api == nullptr || std::strcmp(api, "0") != 0;
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      (runtime_calls && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS)) {
    std::fprintf(stderr, "nq_kernel_trace: CUPTI activity tracing could not start\n");
    return 0;
  }
  std::atexit(WriteTrace);
  return 1;
}
