// nq_moe_bench: the NestQuant MoE block on the GPU at DeepSeek-V3 and GLM-5 shapes (issue #12;
// results and how to rerun them: bench/README.md). A measurement, not a test: it prints one
// line per case with microseconds per block (a CUDA graph of the whole block, replayed), the
// weight bytes the block must read, and their rate over the device-to-device copy bandwidth
// measured in the same run.
//
//   nq_moe_bench [--quick] [--model=dsv3|glm5] [--codec=scalar|trellis] [--lowrank=R]
//     --quick: 1 and 4 tokens only; --model, --codec: that shape or codec only (a device call's
//     experiment can time just the rows it changes, several times over); --lowrank: every expert
//     with rank-R low-rank corrections on all three projections (issue #16; the worst case: the
//     encoder corrects only experts with outlier channels)
//
// Both codecs (nested_scalar_v1, trellis_v1) on the same random planes: the bytes read are the
// same, the decode work is not.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/nq_moe.cuh"
#include "kernels/cuda/nq_moe_prefill.cuh"
#include "kernels/cuda/nq_moe_prefill_dense.cuh"
#include "services/common/status_macros.h"
#include "kernels/tensor_io.h"
#include "tests/kernels/cuda/bench_util.h"

namespace nq::kernels {
namespace {

using ::nq::bench::CopyBandwidth;
using ::nq::bench::DeviceBytes;



// Fills device memory with pseudo-random bytes (xorshift64 on the host, copied in 64 MiB pieces).
void FillRandom(void* dst, std::size_t bytes, std::uint64_t seed) {
  constexpr std::size_t kPiece = 64 << 20;
  std::vector<std::uint64_t> host(kPiece / 8);
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::size_t off = 0; off < bytes; off += kPiece) {
    for (auto& v : host) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      v = s;
    }
    BENCH_CHECK(cudaMemcpy(static_cast<char*>(dst) + off, host.data(), std::min(kPiece, bytes - off),
                           cudaMemcpyHostToDevice));
  }
}

float* UploadFloats(const std::vector<float>& v) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, v.size() * sizeof(float)));
  BENCH_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  return static_cast<float*>(p);
}


struct Model {
  const char* name;
  std::int64_t hidden, intermediate, routed, top_k;
};

struct Layer {
  NqMoeParams p;  // pointers filled, per-case fields set later
  std::int64_t slot_bytes = 0;
  std::vector<void*> owned;
  std::vector<const float*> levels_even, levels_lloyd, levels_nested;  // gate, up, down
};

enum class Levels { kEvenBase, kLloyd, kUniformNested };

// Points the layer's projections at one set of level tables.
void UseLevels(Layer& l, Levels which) {
  const std::vector<const float*>& t = which == Levels::kEvenBase ? l.levels_even
                                       : which == Levels::kLloyd  ? l.levels_lloyd
                                                                  : l.levels_nested;
  l.p.gate.levels = t[0];
  l.p.up.levels = t[1];
  l.p.down.levels = t[2];
}

Layer MakeLayer(const Model& m, std::int64_t experts, std::int64_t lowrank) {
  Layer l;
  const std::int64_t D = m.hidden, I = m.intermediate, plane = NqPlaneBytes(I, D);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> scale(0.02f, 0.06f), col(0.5f, 1.5f);
  auto floats = [&](std::int64_t n, std::uniform_real_distribution<float>& d) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    float* p = UploadFloats(v);
    l.owned.push_back(p);
    return p;
  };
  // Level tables with free (Lloyd) base levels, with an even base grid (nq encode's default:
  // quant::BaseGrid::kUniform, whose 2-bit codes the GEMV decodes without lookups), and uniform
  // nested levels (kUniformNested: the 4-bit codes decoded without lookups too).
  std::vector<float> levels_lloyd, levels_even, levels_nested;
  const float lloyd[4] = {-1.51f, -0.453f, 0.453f, 1.51f}, even[4] = {-1.5f, -0.5f, 0.5f, 1.5f};
  const float offsets[4] = {-0.25f, -0.08f, 0.08f, 0.25f};
  for (std::int64_t e = 0; e < experts; ++e) {
    for (auto [levels, design] : {std::pair{&levels_lloyd, lloyd}, std::pair{&levels_even, even}}) {
      levels->insert(levels->end(), design, design + 4);
      for (int b = 0; b < 4; ++b) {
        for (int r = 0; r < 4; ++r) levels->push_back(design[b] + offsets[r]);
      }
    }
    levels_nested.insert(levels_nested.end(), even, even + 4);
    for (int k = 0; k < 16; ++k) levels_nested.push_back(0.25f * (k - 7.5f));
  }
  auto projection = [&](std::int64_t rows, std::int64_t cols, std::int64_t offset) {
    NqProjectionView v;
    void* base = nullptr;
    BENCH_CHECK(cudaMalloc(&base, experts * plane));
    FillRandom(base, experts * plane, rows * 31 + cols + offset);
    l.owned.push_back(base);
    v.base = static_cast<const std::uint8_t*>(base);
    v.row_scales = floats(experts * rows, scale);
    v.col_scales = floats(experts * cols, col);
    float* lv = UploadFloats(levels_even);
    float* ll = UploadFloats(levels_lloyd);
    float* ln = UploadFloats(levels_nested);
    l.owned.push_back(lv);
    l.owned.push_back(ll);
    l.owned.push_back(ln);
    v.levels = lv;
    l.levels_even.push_back(lv);
    l.levels_lloyd.push_back(ll);
    l.levels_nested.push_back(ln);
    // trellis_v1's per-16-column-block (base, residual) gains, for the cases run as trellis.
    std::uniform_real_distribution<float> gain(0.8f, 1.2f);
    v.gains = floats(experts * (cols / 16) * kNqGainsPerBlock, gain);
    v.residual_offset = offset;
    return v;
  };
  const std::int64_t seg = (plane + 255) / 256 * 256;
  // Low-rank factors: resident F32 per projection, and fp16 ones in each slot after the planes.
  const std::int64_t factors_in_slot[3] = {NqLowRankBytes(I, D, lowrank), NqLowRankBytes(I, D, lowrank),
                                           NqLowRankBytes(D, I, lowrank)};
  std::int64_t slot_end = 3 * seg;
  std::int64_t lowrank_offset[3] = {-1, -1, -1};
  for (int j = 0; j < 3 && lowrank > 0; ++j) {
    lowrank_offset[j] = slot_end;
    slot_end = (slot_end + factors_in_slot[j] + 255) / 256 * 256;
  }
  l.slot_bytes = (slot_end + 4095) / 4096 * 4096;
  l.p.hidden = D;
  l.p.intermediate = I;
  l.p.num_experts = experts;
  l.p.gate = projection(I, D, 0);
  l.p.up = projection(I, D, seg);
  l.p.down = projection(D, I, 2 * seg);
  l.p.lowrank_rank = lowrank;
  if (lowrank > 0) {
    std::uniform_real_distribution<float> factor(-0.01f, 0.01f);
    NqProjectionView* views[3] = {&l.p.gate, &l.p.up, &l.p.down};
    for (int j = 0; j < 3; ++j) {
      const std::int64_t rows = j < 2 ? I : D, cols = j < 2 ? D : I;
      views[j]->lowrank_u = floats(experts * rows * lowrank, factor);
      views[j]->lowrank_v = floats(experts * lowrank * cols, factor);
      views[j]->lowrank_offset = lowrank_offset[j];
    }
  }
  std::bernoulli_distribution coin(0.5);
  auto signs = [&](std::int64_t n) {
    std::vector<float> s(static_cast<size_t>(n));
    for (auto& v : s) v = coin(rng) ? 1.0f : -1.0f;
    float* p = UploadFloats(s);
    l.owned.push_back(p);
    return p;
  };
  l.p.input = {signs(D), 128};
  l.p.gate_rows = {signs(I), 128};
  l.p.down_cols = {signs(I), 512};
  l.p.down_rows = {signs(D), 128};
  void* arena = nullptr;
  BENCH_CHECK(cudaMalloc(&arena, experts * l.slot_bytes));
  FillRandom(arena, experts * l.slot_bytes, 99);
  // The slots' factors as zeros, not random bits (which would include fp16 NaNs).
  for (int j = 0; j < 3 && lowrank > 0; ++j) {
    BENCH_CHECK(cudaMemset2D(static_cast<std::uint8_t*>(arena) + lowrank_offset[j], l.slot_bytes, 0,
                             factors_in_slot[j], experts));
  }
  l.owned.push_back(arena);
  l.p.arena = static_cast<const std::uint8_t*>(arena);
  l.p.slot_bytes = l.slot_bytes;
  l.p.num_slots = experts;
  return l;
}

enum class Path { kDecode, kGroupedPrefill, kDensePrefill };

struct Bench {
  const char* scalar_name = "scalar";  // the scalar codec's label: "scalar" (even grid) or "lloyd"
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  cuda::DensePrefillResources dense;
  double copy_bw = 0;
};

void RunCase(const Model& m, Layer& l, NqCodec codec, Path path, std::int64_t tokens, int mode, const Bench& b) {
  cudaStream_t stream = b.stream;
  void* workspace = b.workspace;
  const std::size_t workspace_bytes = b.workspace_bytes;
  const double copy_bw = b.copy_bw;
  const std::int64_t E = l.p.num_experts, K = m.top_k + 1;  // + the shared expert (id E - 1)
  std::mt19937_64 rng(tokens * 3 + mode);
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<std::int32_t> all(static_cast<size_t>(m.routed));
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + m.top_k);
    ids.push_back(static_cast<std::int32_t>(E - 1));
    for (std::int64_t k = 0; k < K; ++k) weights.push_back(k + 1 == K ? 1.0f : 0.3f);
  }
  std::vector<std::int32_t> slots(static_cast<size_t>(E), -1);
  std::bernoulli_distribution coin(0.5);
  for (std::int64_t e = 0; e < E; ++e) {
    if (mode == 1 || (mode == 2 && coin(rng))) slots[e] = static_cast<std::int32_t>(e);
  }
  // The path the CUDA backend takes (cuda_backend.cu) and the weight bytes it must read: each
  // distinct expert of each chunk once (decode: 4 tokens; prefill: once per 64-token tile, counted
  // here once per chunk, the floor).
  const std::int64_t chunk = path == Path::kDecode          ? cuda::kNqMaxDecodeTokens
                             : path == Path::kGroupedPrefill ? cuda::kNqPrefillChunk
                                                             : cuda::kNqDensePrefillChunk;
  double bytes = 0, flops = 0;
  const std::int64_t plane = NqPlaneBytes(m.intermediate, m.hidden);
  flops = 2.0 * tokens * K * 3.0 * m.intermediate * m.hidden;
  for (std::int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    std::set<std::int32_t> distinct(ids.begin() + t0 * K, ids.begin() + std::min(tokens, t0 + chunk) * K);
    for (std::int32_t e : distinct) {
      bytes += 3.0 * plane * (slots[e] >= 0 ? 2 : 1) + 4.0 * (3 * m.intermediate + 3 * m.hidden) + 4 * 20 * 3;
      // Low-rank factors: F32 resident, fp16 in the slot (3 projections, rows + cols each).
      bytes += 3.0 * l.p.lowrank_rank * (m.intermediate + m.hidden) * (4 + (slots[e] >= 0 ? 2 : 0));
    }
  }
  NqMoeParams p = l.p;
  p.codec = codec;
  p.tokens = tokens;
  p.top_k = K;
  std::vector<float> x(static_cast<size_t>(tokens * m.hidden));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(rng);
  float* dx = UploadFloats(x);
  float* dw = UploadFloats(weights);
  void* dids = nullptr;
  BENCH_CHECK(cudaMalloc(&dids, ids.size() * 4));
  BENCH_CHECK(cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  void* dslots = nullptr;
  BENCH_CHECK(cudaMalloc(&dslots, slots.size() * 4));
  BENCH_CHECK(cudaMemcpy(dslots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
  void* dout = nullptr;
  BENCH_CHECK(cudaMalloc(&dout, x.size() * 4));
  p.x = dx;
  p.expert_weights = dw;
  p.expert_ids = static_cast<const std::int32_t*>(dids);
  p.slot_of_expert = static_cast<const std::int32_t*>(dslots);
  p.out = static_cast<float*>(dout);
  const cuda::LaunchContext ctx{.stream = stream, .num_sms = 132};
  auto launch = [&]() -> absl::Status {
    switch (path) {
      case Path::kDecode:
        return cuda::LaunchNqMoe(p, workspace, workspace_bytes, ctx);
      case Path::kGroupedPrefill:
        return cuda::LaunchNqMoePrefill(p, workspace, workspace_bytes, ctx);
      case Path::kDensePrefill:
        for (std::int64_t t0 = 0; t0 < p.tokens; t0 += cuda::kNqDensePrefillChunk) {
          const NqMoeParams c = NqMoeTokenChunk(p, t0, std::min(cuda::kNqDensePrefillChunk, p.tokens - t0));
          RETURN_IF_ERROR(cuda::LaunchNqMoeDensePrefill(c, workspace, workspace_bytes, b.dense, ctx));
        }
        return absl::OkStatus();
    }
    return absl::InternalError("unknown path");
  };
  BENCH_OK(launch());  // warm-up
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const int iters = tokens <= 4 ? 200 : 10;
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  cudaGraphExec_t exec = nullptr;
  if (path == Path::kDensePrefill) {
    // Not capturable (it reads the group sizes on the host): timed as issued, its one
    // synchronisation per chunk included.
    BENCH_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < iters; ++i) BENCH_OK(launch());
    BENCH_CHECK(cudaEventRecord(stop, stream));
  } else {
    cudaGraph_t graph;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    BENCH_OK(launch());
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
    BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    BENCH_CHECK(cudaGraphDestroy(graph));
    BENCH_CHECK(cudaGraphLaunch(exec, stream));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    BENCH_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < iters; ++i) BENCH_CHECK(cudaGraphLaunch(exec, stream));
    BENCH_CHECK(cudaEventRecord(stop, stream));
  }
  BENCH_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
  const double us = ms * 1e3 / iters;
  const char* mode_name[] = {"2-bit", "4-bit", "half/half"};
  std::printf(
      "%-5s %-8s T=%-5lld %-9s %-7s %10.1f us  %8.1f MB  %6.2f TB/s  ratio to copy %.3f  %7.1f TFLOP/s  lowrank %lld\n",
      m.name, codec == NqCodec::kTrellis ? "trellis" : b.scalar_name, static_cast<long long>(tokens), mode_name[mode],
      path == Path::kDecode ? "decode" : path == Path::kGroupedPrefill ? "grouped" : "dense", us, bytes / 1e6,
      bytes / (us * 1e-6) / 1e12, bytes / (us * 1e-6) / copy_bw, flops / (us * 1e-6) / 1e12,
      static_cast<long long>(l.p.lowrank_rank));
  std::fflush(stdout);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* q : {static_cast<void*>(dx), static_cast<void*>(dw), dids, dslots, dout}) cudaFree(q);
}

}  // namespace
}  // namespace nq::kernels

int main(int argc, char** argv) {
  using namespace nq::kernels;
  bool quick = false;
  std::string only_model, only_codec;
  int lowrank = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg.rfind("--model=", 0) == 0) {
      only_model = arg.substr(8);
    } else if (arg.rfind("--codec=", 0) == 0) {
      only_codec = arg.substr(8);
    } else if (arg.rfind("--lowrank=", 0) == 0 && arg.size() == 11 && arg[10] >= '0' &&
               arg[10] - '0' <= kNqMaxLowRank) {
      lowrank = arg[10] - '0';
    } else {
      std::fprintf(stderr, "usage: nq_moe_bench [--quick] [--model=dsv3|glm5] [--codec=scalar|trellis] [--lowrank=0..4]\n");
      return 2;
    }
  }
  if ((!only_model.empty() && only_model != "dsv3" && only_model != "glm5") ||
      (!only_codec.empty() && only_codec != "scalar" && only_codec != "trellis")) {
    std::fprintf(stderr, "nq_moe_bench: --model takes dsv3 or glm5, --codec scalar or trellis\n");
    return 2;
  }
  Bench bench;
  bench.copy_bw = CopyBandwidth();
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n", bench.copy_bw / 1e12);
  BENCH_CHECK(cudaStreamCreateWithFlags(&bench.stream, cudaStreamNonBlocking));
  if (cublasCreate(&bench.dense.blas) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    return 1;
  }
  BENCH_CHECK(cudaStreamCreateWithFlags(&bench.dense.side, cudaStreamNonBlocking));
  for (cudaEvent_t* event : {&bench.dense.start, &bench.dense.ready[0], &bench.dense.ready[1], &bench.dense.free[0],
                             &bench.dense.free[1]}) {
    BENCH_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  }
  for (const Model& m : {Model{"dsv3", 7168, 2048, 32, 8}, Model{"glm5", 6144, 2048, 256, 8}}) {
    if (!only_model.empty() && only_model != m.name) continue;
    Layer layer = MakeLayer(m, m.routed + 1, lowrank);
    const std::int64_t K = m.top_k + 1, E = m.routed + 1;
    bench.workspace_bytes = std::max({cuda::NqMoeWorkspaceBytes(K, m.hidden, m.intermediate),
                                      cuda::NqMoePrefillWorkspaceBytes(K, m.hidden, m.intermediate, E),
                                      cuda::NqMoeDensePrefillWorkspaceBytes(K, m.hidden, m.intermediate, E)});
    DeviceBytes ws(bench.workspace_bytes);
    bench.workspace = ws.p;
    void* pinned = nullptr;
    BENCH_CHECK(cudaMallocHost(&pinned, 2 * E * sizeof(int)));
    bench.dense.host_counts = static_cast<int*>(pinned);
    bench.dense.host_capacity = 2 * E;
    for (const NqCodec codec : {NqCodec::kNestedScalar, NqCodec::kTrellis}) {
      if (!only_codec.empty() && only_codec != (codec == NqCodec::kTrellis ? "trellis" : "scalar")) continue;
      for (const std::int64_t tokens : {1, 4, 512, 4096}) {
        if (quick && tokens > 4) continue;
        // Prefill sizes through both prefill paths (the backend picks by NqMoeDensePrefillPays);
        // the grouped path at 4096 only for the scalar codec (slow).
        std::vector<Path> paths = {Path::kDecode};
        if (tokens > 4) paths = {Path::kGroupedPrefill, Path::kDensePrefill};
        if (tokens == 4096 && codec == NqCodec::kTrellis) paths = {Path::kDensePrefill};
        for (const Path path : paths) {
          for (int mode = 0; mode < 3; ++mode) RunCase(m, layer, codec, path, tokens, mode, bench);
          // The decode GEMV's table-lookup 2-bit decode, for releases with free base levels, and
          // its lookup-free 4-bit decode, for releases with uniform nested levels.
          if (codec == NqCodec::kNestedScalar && path == Path::kDecode) {
            UseLevels(layer, Levels::kLloyd);
            bench.scalar_name = "lloyd";
            for (int mode = 0; mode < 3; ++mode) RunCase(m, layer, codec, path, tokens, mode, bench);
            UseLevels(layer, Levels::kUniformNested);
            bench.scalar_name = "nested";
            for (int mode = 1; mode < 3; ++mode) RunCase(m, layer, codec, path, tokens, mode, bench);
            UseLevels(layer, Levels::kEvenBase);
            bench.scalar_name = "scalar";
          }
        }
      }
    }
    BENCH_CHECK(cudaFreeHost(pinned));
    for (void* p : layer.owned) cudaFree(p);
  }
  cublasDestroy(bench.dense.blas);
  return 0;
}
