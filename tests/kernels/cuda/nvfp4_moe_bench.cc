// nvfp4_moe_bench: the NVFP4 routed-expert block on the GPU at DeepSeek-V3 and GLM-5 expert
// shapes (issue #20; results and how to rerun them: bench/README.md, "NVFP4 checkpoints"). A
// measurement, not a test: one line per case with microseconds per block (a CUDA graph of the
// whole block -- input prep, gate/up GEMV, SwiGLU, down GEMV, combine -- replayed), the weight
// bytes the block must read (codes, block scales and global scales of each distinct expert), and
// their rate over the device-to-device copy bandwidth measured in the same run.
//
//   nvfp4_moe_bench [--quick]     (--quick: DeepSeek-V3 shapes only)
//
// Then prompts (64, 512 and 4096 tokens, random routing) through both paths the backend can take:
// the decode chunks of 8 tokens (a CUDA graph) and the dense prefill (each expert dequantised once
// to fp16, its tokens through cuBLAS; not capturable, timed as issued); milliseconds per block,
// tokens per second and the dense path's speedup.
//
// Routing: "shared" sends every token to the same top_k experts (the batch of 8 experts the
// target is set on); "random" draws each token's experts from all of them (up to T x top_k
// distinct experts). The layer holds 64 experts (1.6 GB at DeepSeek-V3 shapes), far more than
// the 50 MB L2, so codes come from HBM.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/cuda/nvfp4_gemv.cuh"
#include "kernels/cuda/nvfp4_moe.cuh"
#include "kernels/cuda/nvfp4_moe_prefill_dense.cuh"
#include "kernels/nvfp4_codes.h"
#include "kernels/nvfp4_moe_params.h"
#include "tests/kernels/cuda/bench_util.h"

namespace nq::kernels {
namespace {

using ::nq::bench::CopyBandwidth;
using ::nq::bench::DeviceBytes;
using ::nq::bench::GraphReplayMicros;

constexpr std::int64_t kExperts = 64;

// Fills device memory with pseudo-random bytes (xorshift64 on the host, 64 MiB pieces); with
// `scales`, each byte is mapped into the E4M3 codes 0x38..0x7E a quantizer writes (1 to 448).
void FillRandom(void* dst, std::size_t bytes, std::uint64_t seed, bool scales) {
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
    if (scales) {
      auto* b = reinterpret_cast<std::uint8_t*>(host.data());
      for (std::size_t i = 0; i < kPiece; ++i) b[i] = static_cast<std::uint8_t>(0x38 + b[i] % (0x7E - 0x38 + 1));
    }
    BENCH_CHECK(cudaMemcpy(static_cast<char*>(dst) + off, host.data(), std::min(kPiece, bytes - off),
                           cudaMemcpyHostToDevice));
  }
}

template <typename T>
T* Upload(const std::vector<T>& v) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, v.size() * sizeof(T)));
  BENCH_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

struct Model {
  const char* name;
  std::int64_t hidden, intermediate, top_k;
};

struct Layer {
  Nvfp4MoeParams p;
  std::vector<void*> owned;
  double expert_bytes = 0;
};

Nvfp4ProjectionView Projection(Layer& l, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  const std::size_t packed = kExperts * rows * cols / 2, scales = kExperts * rows * cols / kNvfp4BlockSize;
  void* a = nullptr;
  void* b = nullptr;
  BENCH_CHECK(cudaMalloc(&a, packed));
  BENCH_CHECK(cudaMalloc(&b, scales));
  FillRandom(a, packed, seed, false);
  FillRandom(b, scales, seed + 1, true);
  float* global = Upload(std::vector<float>(kExperts, 1e-3f));
  l.owned.insert(l.owned.end(), {a, b, global});
  l.expert_bytes += static_cast<double>(packed + scales) / kExperts + sizeof(float);
  return {.packed = static_cast<const std::uint8_t*>(a), .scales = static_cast<const std::uint8_t*>(b),
          .global_scales = global};
}

Layer MakeLayer(const Model& m) {
  Layer l;
  l.p.hidden = m.hidden;
  l.p.intermediate = m.intermediate;
  l.p.num_experts = kExperts;
  l.p.gate_up = Projection(l, 2 * m.intermediate, m.hidden, 11);
  l.p.down = Projection(l, m.hidden, m.intermediate, 23);
  return l;
}

// A launch context on `stream` with the current device's SM count.
cuda::LaunchContext ContextOn(cudaStream_t stream) {
  int device = 0, sms = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return {.stream = stream, .num_sms = sms};
}

// The per-case inputs a case uploaded (x, ids, weights).
void FreeInputs(const Nvfp4MoeParams& p) {
  for (const void* q : {static_cast<const void*>(p.x), static_cast<const void*>(p.expert_ids),
                        static_cast<const void*>(p.expert_weights)}) {
    BENCH_CHECK(cudaFree(const_cast<void*>(q)));
  }
}

// The two expert GEMVs of a chunk alone (gate/up, then down), without the block's three small
// kernels: what "the NVFP4 expert GEMV against copy bandwidth" measures. The inputs are zero
// and the outputs accumulate across replays; only the time counts.
double GemvOnlyMicroseconds(const Model& m, const Nvfp4MoeParams& p, cudaStream_t stream,
                            const cuda::LaunchContext& ctx) {
  const std::int64_t T = std::min<std::int64_t>(p.tokens, cuda::kNvfp4MaxDecodeTokens), K = m.top_k;
  const std::int64_t D = m.hidden, I = m.intermediate, A = T * K;
  DeviceBytes xh(T * D * 2), hg(A * 2 * I * 4), ah(A * I * 2), yd(A * D * 4);
  BENCH_CHECK(cudaMemset(xh.p, 0, T * D * 2));
  BENCH_CHECK(cudaMemset(ah.p, 0, A * I * 2));
  cuda::Nvfp4GemvParams gate_up{.expert_ids = p.expert_ids,
                                .assignments = static_cast<int>(A),
                                .top_k = static_cast<int>(K),
                                .num_experts = static_cast<int>(p.num_experts),
                                .w = p.gate_up,
                                .rows = static_cast<int>(2 * I),
                                .cols = static_cast<int>(D),
                                .x = static_cast<const __half*>(xh.p),
                                .x_per_token = true,
                                .out = static_cast<float*>(hg.p),
                                .out_stride = 2 * I};
  cuda::Nvfp4GemvParams down = gate_up;
  down.w = p.down;
  down.rows = static_cast<int>(D);
  down.cols = static_cast<int>(I);
  down.x = static_cast<const __half*>(ah.p);
  down.x_per_token = false;
  down.out = static_cast<float*>(yd.p);
  down.out_stride = D;
  return GraphReplayMicros(stream, 200, [&] {
    BENCH_OK(cuda::LaunchNvfp4Gemv(gate_up, ctx));
    BENCH_OK(cuda::LaunchNvfp4Gemv(down, ctx));
  });
}

void RunCase(const Model& m, const Layer& l, std::int64_t tokens, bool shared, cudaStream_t stream, void* workspace,
             std::size_t workspace_bytes, double copy_bw) {
  const std::int64_t K = m.top_k;
  std::mt19937_64 rng(tokens * 7 + (shared ? 1 : 0));
  std::vector<std::int32_t> all(kExperts), ids;
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (!shared) std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + K);
  }
  std::vector<float> weights(ids.size(), 1.0f / static_cast<float>(K));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens * m.hidden));
  for (auto& v : x) v = normal(rng);
  // Weight bytes read: each distinct expert of each chunk once.
  double bytes = 0;
  for (std::int64_t t0 = 0; t0 < tokens; t0 += cuda::kNvfp4MaxDecodeTokens) {
    const std::int64_t t1 = std::min(tokens, t0 + cuda::kNvfp4MaxDecodeTokens);
    bytes += l.expert_bytes * static_cast<double>(std::set<std::int32_t>(ids.begin() + t0 * K, ids.begin() + t1 * K).size());
  }
  Nvfp4MoeParams p = l.p;
  p.tokens = tokens;
  p.top_k = K;
  p.x = Upload(x);
  p.expert_ids = Upload(ids);
  p.expert_weights = Upload(weights);
  DeviceBytes out(x.size() * sizeof(float));
  p.out = static_cast<float*>(out.p);
  const cuda::LaunchContext ctx = ContextOn(stream);
  BENCH_OK(cuda::LaunchNvfp4Moe(p, workspace, workspace_bytes, ctx));  // warm-up
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const double us =
      GraphReplayMicros(stream, 200, [&] { BENCH_OK(cuda::LaunchNvfp4Moe(p, workspace, workspace_bytes, ctx)); });
  const double rate = bytes / (us * 1e-6);
  std::printf("nvfp4 %-5s D=%-5lld I=%-5lld K=%-2lld T=%-3lld %-6s %9.1f us  %8.1f MB  %6.2f TB/s  ratio to copy %.3f\n",
              m.name, static_cast<long long>(m.hidden), static_cast<long long>(m.intermediate),
              static_cast<long long>(K), static_cast<long long>(tokens), shared ? "shared" : "random", us, bytes / 1e6,
              rate / 1e12, rate / copy_bw);
  if (tokens <= cuda::kNvfp4MaxDecodeTokens) {  // one chunk: the block's bytes are the GEMVs' bytes
    const double gemv_us = GemvOnlyMicroseconds(m, p, stream, ctx), gemv_rate = bytes / (gemv_us * 1e-6);
    std::printf("nvfp4 %-5s D=%-5lld I=%-5lld K=%-2lld T=%-3lld %-6s %9.1f us  GEMVs alone          %6.2f TB/s  ratio to copy %.3f\n",
                m.name, static_cast<long long>(m.hidden), static_cast<long long>(m.intermediate),
                static_cast<long long>(K), static_cast<long long>(tokens), shared ? "shared" : "random", gemv_us,
                gemv_rate / 1e12, gemv_rate / copy_bw);
  }
  std::fflush(stdout);
  FreeInputs(p);
}

// A prompt of `tokens` through the decode chunks and through the dense prefill.
void RunPrefillCase(const Model& m, const Layer& l, std::int64_t tokens, cudaStream_t stream, void* workspace,
                    std::size_t workspace_bytes, const cuda::DensePrefillResources& dense) {
  const std::int64_t K = m.top_k;
  std::mt19937_64 rng(tokens * 11 + 5);
  std::vector<std::int32_t> all(kExperts), ids;
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + K);
  }
  std::vector<float> weights(ids.size(), 1.0f / static_cast<float>(K));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens * m.hidden));
  for (auto& v : x) v = normal(rng);
  Nvfp4MoeParams p = l.p;
  p.tokens = tokens;
  p.top_k = K;
  p.x = Upload(x);
  p.expert_ids = Upload(ids);
  p.expert_weights = Upload(weights);
  DeviceBytes out(x.size() * sizeof(float));
  p.out = static_cast<float*>(out.p);
  const cuda::LaunchContext ctx = ContextOn(stream);
  const int replays = tokens >= 4096 ? 3 : 10;
  BENCH_OK(cuda::LaunchNvfp4Moe(p, workspace, workspace_bytes, ctx));  // warm-up
  const double chunks_us =
      GraphReplayMicros(stream, replays, [&] { BENCH_OK(cuda::LaunchNvfp4Moe(p, workspace, workspace_bytes, ctx)); });
  const auto dense_call = [&] {
    for (std::int64_t t0 = 0; t0 < tokens; t0 += cuda::kNvfp4DensePrefillChunk) {
      const Nvfp4MoeParams c = Nvfp4MoeTokenChunk(p, t0, std::min(cuda::kNvfp4DensePrefillChunk, tokens - t0));
      BENCH_OK(cuda::LaunchNvfp4MoeDensePrefill(c, workspace, workspace_bytes, dense, ctx));
    }
  };
  dense_call();  // warm-up
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  BENCH_CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < replays; ++r) dense_call();
  BENCH_CHECK(cudaEventRecord(stop, stream));
  BENCH_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
  const double dense_us = 1e3 * ms / replays;
  std::printf("nvfp4 %-5s D=%-5lld I=%-5lld K=%-2lld T=%-5lld prompt  chunks of 8 %9.3f ms (%8.0f tokens/s)  "
              "dense %8.3f ms (%8.0f tokens/s)  dense speedup %.2fx%s\n",
              m.name, static_cast<long long>(m.hidden), static_cast<long long>(m.intermediate),
              static_cast<long long>(K), static_cast<long long>(tokens), chunks_us / 1e3, tokens / (chunks_us * 1e-6),
              dense_us / 1e3, tokens / (dense_us * 1e-6), chunks_us / dense_us,
              cuda::Nvfp4MoeDensePrefillPays(p) ? "  (the backend takes dense)" : "  (the backend takes chunks)");
  std::fflush(stdout);
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  FreeInputs(p);
}

// cuBLAS, a side stream, five events and a pinned buffer for the dense prefill.
cuda::DensePrefillResources MakeDenseResources() {
  cuda::DensePrefillResources r;
  if (cublasCreate(&r.blas) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    std::exit(1);
  }
  BENCH_CHECK(cudaStreamCreateWithFlags(&r.side, cudaStreamNonBlocking));
  for (cudaEvent_t* event : {&r.start, &r.ready[0], &r.ready[1], &r.free[0], &r.free[1]}) {
    BENCH_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  }
  void* pinned = nullptr;
  BENCH_CHECK(cudaMallocHost(&pinned, 2 * kExperts * sizeof(int)));
  r.host_counts = static_cast<int*>(pinned);
  r.host_capacity = 2 * kExperts;
  return r;
}

}  // namespace
}  // namespace nq::kernels

int main(int argc, char** argv) {
  using namespace nq::kernels;
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const double copy_bw = CopyBandwidth();
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n", copy_bw / 1e12);
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cuda::DensePrefillResources dense = MakeDenseResources();
  for (const Model& m : {Model{"dsv3", 7168, 2048, 8}, Model{"glm5", 6144, 2048, 8}}) {
    if (quick && std::strcmp(m.name, "dsv3") != 0) continue;
    Layer layer = MakeLayer(m);
    const std::size_t workspace_bytes =
        std::max(cuda::Nvfp4MoeWorkspaceBytes(m.top_k, m.hidden, m.intermediate),
                 cuda::Nvfp4MoeDensePrefillWorkspaceBytes(4096, m.top_k, m.hidden, m.intermediate, kExperts));
    DeviceBytes workspace(workspace_bytes);
    for (const bool shared : {true, false}) {
      for (const std::int64_t tokens : {1, 2, 3, 4, 8}) {
        if (shared || tokens > 1) RunCase(m, layer, tokens, shared, stream, workspace.p, workspace_bytes, copy_bw);
      }
    }
    for (const std::int64_t tokens : {64, 512, 4096}) {
      RunPrefillCase(m, layer, tokens, stream, workspace.p, workspace_bytes, dense);
    }
    for (void* q : layer.owned) BENCH_CHECK(cudaFree(q));
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
