// nvfp4_moe_bench: the NVFP4 routed-expert block on the GPU at DeepSeek-V3 and GLM-5 expert
// shapes (issue #20; results and how to rerun them: bench/README.md, "NVFP4 checkpoints"). A
// measurement, not a test: one line per case with microseconds per block (a CUDA graph of the
// whole block -- input prep, gate/up GEMV, SwiGLU, down GEMV, combine -- replayed), the weight
// bytes the block must read (codes, block scales and global scales of each distinct expert), and
// their rate over the device-to-device copy bandwidth measured in the same run.
//
//   nvfp4_moe_bench [--quick]     (--quick: DeepSeek-V3 shapes only)
//
// Routing: "shared" sends every token to the same top_k experts (the batch of 8 experts the
// target is set on); "random" draws each token's experts from all of them (up to T x top_k
// distinct experts). The layer holds 64 experts (1.6 GB at DeepSeek-V3 shapes), far more than
// the 50 MB L2, so codes come from HBM.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/cuda/nvfp4_gemv.cuh"
#include "kernels/cuda/nvfp4_moe.cuh"
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
  const cuda::LaunchContext ctx{.stream = stream, .num_sms = [] {
                                  int device = 0, sms = 0;
                                  BENCH_CHECK(cudaGetDevice(&device));
                                  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
                                  return sms;
                                }()};
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
  for (const void* q : {static_cast<const void*>(p.x), static_cast<const void*>(p.expert_ids),
                        static_cast<const void*>(p.expert_weights)}) {
    BENCH_CHECK(cudaFree(const_cast<void*>(q)));
  }
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
  for (const Model& m : {Model{"dsv3", 7168, 2048, 8}, Model{"glm5", 6144, 2048, 8}}) {
    if (quick && std::strcmp(m.name, "dsv3") != 0) continue;
    Layer layer = MakeLayer(m);
    const std::size_t workspace_bytes = cuda::Nvfp4MoeWorkspaceBytes(m.top_k, m.hidden, m.intermediate);
    DeviceBytes workspace(workspace_bytes);
    for (const bool shared : {true, false}) {
      for (const std::int64_t tokens : {1, 2, 3, 4, 8}) {
        if (shared || tokens > 1) RunCase(m, layer, tokens, shared, stream, workspace.p, workspace_bytes, copy_bw);
      }
    }
    for (void* q : layer.owned) BENCH_CHECK(cudaFree(q));
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
