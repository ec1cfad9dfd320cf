// mla_decode_bench: MLA decode attention on the GPU at DeepSeek-V3 shapes (issue #13; results
// and how to rerun them: bench/README.md). A measurement, not a test: one line per case with
// microseconds per call and the bytes the call must read (the keys it attends, rope keys
// included, plus w_uk and w_uv) over the device-to-device copy bandwidth measured in the same run.
//
// Each case runs on enough independent copies of its cache and weights (like consecutive layers)
// that nothing stays in the 50 MB L2 between calls: a CUDA graph runs every copy once, replayed.
//
//   mla_decode_bench [--sweep|--quick] [--only NAME]   (--sweep: also every split count from 8
//     to 256; --quick: the first case only, for a profiler; --only: the cases whose name holds
//     NAME, e.g. "glm5")
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/mla_attention.cuh"
#include "kernels/cuda/mla_decode.cuh"
#include "kernels/kv_fp8.h"
#include "tests/kernels/cuda/bench_util.h"

namespace nq::kernels::cuda {
namespace {

using ::nq::bench::GraphReplayMicros;


constexpr std::size_t kColdBytes = std::size_t{400} << 20;  // 8x the L2

void* DeviceRandom(std::size_t bytes, std::uint64_t seed, bool bf16) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, bytes));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, bf16 ? 0.05f : 1.0f);
  std::vector<std::uint8_t> host(bytes);
  if (bf16) {
    for (std::size_t i = 0; i + 1 < bytes; i += 2) {
      const float v = normal(rng);
      std::uint32_t u;
      std::memcpy(&u, &v, 4);
      const std::uint16_t h = static_cast<std::uint16_t>(u >> 16);
      std::memcpy(host.data() + i, &h, 2);
    }
  } else {
    for (std::size_t i = 0; i + 3 < bytes; i += 4) {
      const float v = normal(rng);
      std::memcpy(host.data() + i, &v, 4);
    }
  }
  BENCH_CHECK(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
  return p;
}

// Packed FP8 rows (kernels/kv_fp8.h) of normal latent values, made once per case and uploaded to
// each copy.
std::vector<std::uint8_t> Fp8Rows(int keys, int c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t width = KvFp8RowBytes(c);
  std::vector<std::uint8_t> rows(static_cast<std::size_t>(keys * width));
  std::vector<float> x(static_cast<std::size_t>(c));
  for (int s = 0; s < keys; ++s) {
    for (float& v : x) v = normal(rng);
    PackKvFp8Row(x.data(), c, rows.data() + s * width);
  }
  return rows;
}


enum class Cache { kF32, kBf16, kFp8 };  // FP8: packed latent rows, BF16 rope key

struct Case {
  const char* name;
  int tokens, heads, keys, top_k;  // top_k 0: dense
  Cache cache = Cache::kF32;
  int dn = 128, dv = 128;  // DeepSeek-V3's; GLM-5: 192, 256
};

struct Instance {
  MlaAttentionParams p;
  std::vector<void*> owned;
};

enum class Kernel { kSplit, kPerHead };

// µs per call of `kernel` on `copies` instances (graph of all, replayed).
double TimeCase(std::vector<Instance>& copies, Kernel kernel, int splits, int num_sms, cudaStream_t stream,
                std::vector<void*>& scratch) {
  auto launch = [&]() {
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const MlaAttentionParams& p = copies[i].p;
      if (kernel == Kernel::kPerHead) {
        BENCH_OK(LaunchMlaAttention(p, {.stream = stream, .num_sms = num_sms}));
        continue;
      }
      const MlaDecodePlan plan = PlanMlaDecode(p, num_sms, splits);
      BENCH_OK(LaunchMlaDecode(p, plan, scratch[i], plan.ScratchBytes(), {.stream = stream, .num_sms = num_sms}));
    }
  };
  launch();  // once outside the graph: its first launches set the split kernel's attributes
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const int iters = kernel == Kernel::kPerHead ? 2 : 20;
  return GraphReplayMicros(stream, iters, launch) / static_cast<double>(copies.size());
}

void RunCase(const Case& c, double copy_bw, int num_sms, cudaStream_t stream, bool sweep) {
  const int kDn = c.dn, kDv = c.dv;
  constexpr int kDr = 64, kC = 512;
  const std::size_t kv_elem = c.cache == Cache::kF32 ? 4 : 2;  // FP8 rows: the rope key's
  const std::size_t row_bytes = c.cache == Cache::kFp8 ? KvFp8RowBytes(kC) : kv_elem * kC;
  const std::size_t kv_bytes = row_bytes * c.keys, pe_bytes = kv_elem * c.keys * kDr;
  const std::vector<std::uint8_t> fp8_rows = c.cache == Cache::kFp8 ? Fp8Rows(c.keys, kC, c.keys * 7 + 1) : std::vector<std::uint8_t>{};
  const std::size_t uk_bytes = std::size_t{2} * c.heads * kDn * kC;  // bf16
  const std::size_t uv_bytes = std::size_t{2} * c.heads * kDv * kC;
  const std::size_t instance_bytes = kv_bytes + pe_bytes + uk_bytes + uv_bytes;
  const int n = static_cast<int>(std::clamp<std::size_t>(kColdBytes / instance_bytes + 1, 2, 64));
  std::vector<Instance> copies(n);
  std::vector<void*> scratch(n, nullptr);
  std::mt19937_64 rng(c.keys * 131 + c.heads);
  for (int i = 0; i < n; ++i) {
    Instance& in = copies[i];
    auto add = [&](std::size_t bytes, bool bf16) {
      in.owned.push_back(DeviceRandom(bytes, rng(), bf16));
      return in.owned.back();
    };
    MlaAttentionParams& p = in.p;
    p.q_nope = static_cast<float*>(add(std::size_t{4} * c.tokens * c.heads * kDn, false));
    p.q_pe = static_cast<float*>(add(std::size_t{4} * c.tokens * c.heads * kDr, false));
    p.kv_latent = add(kv_bytes, c.cache == Cache::kBf16);
    if (c.cache == Cache::kFp8) {
      BENCH_CHECK(cudaMemcpy(const_cast<void*>(p.kv_latent), fp8_rows.data(), kv_bytes, cudaMemcpyHostToDevice));
    }
    p.k_pe = add(pe_bytes, c.cache != Cache::kF32);
    p.kv_dtype = c.cache == Cache::kF32 ? DType::kF32 : c.cache == Cache::kBf16 ? DType::kBF16 : DType::kU8;
    p.w_uk = add(uk_bytes, true);
    p.w_uk_dtype = DType::kBF16;
    p.w_uv = add(uv_bytes, true);
    p.w_uv_dtype = DType::kBF16;
    p.out = static_cast<float*>(add(std::size_t{4} * c.tokens * c.heads * kDv, false));
    if (c.top_k > 0) {  // every other key of the cache, the last ones (a recent-window-like pick)
      std::vector<std::int32_t> sel(static_cast<std::size_t>(c.tokens) * c.top_k);
      for (int t = 0; t < c.tokens; ++t) {
        for (int k = 0; k < c.top_k; ++k) sel[t * c.top_k + k] = std::max(0, c.keys - c.tokens - 2 * k);
      }
      void* d = nullptr;
      BENCH_CHECK(cudaMalloc(&d, sel.size() * 4));
      BENCH_CHECK(cudaMemcpy(d, sel.data(), sel.size() * 4, cudaMemcpyHostToDevice));
      in.owned.push_back(d);
      p.selected = static_cast<std::int32_t*>(d);
      p.top_k = c.top_k;
    }
    p.tokens = c.tokens;
    p.heads = c.heads;
    p.dn = kDn;
    p.dr = kDr;
    p.c = kC;
    p.dv = kDv;
    p.start_pos = c.keys - c.tokens;
    p.scale = 0.0722f;
    const MlaDecodePlan plan = PlanMlaDecode(p, num_sms, kMlaMaxSplits);  // the most scratch
    BENCH_CHECK(cudaMalloc(&scratch[i], plan.ScratchBytes()));
  }
  const std::int64_t rows = c.top_k > 0 ? std::int64_t{c.tokens} * c.top_k : c.keys;  // keys attended (read once)
  const double bytes = static_cast<double>(rows) * (row_bytes + kDr * kv_elem) + static_cast<double>(uk_bytes + uv_bytes);
  auto print = [&](const char* kernel, int splits, double us) {
    std::printf("%-26s T=%d H=%-3d keys=%-6d %-9s splits=%-4d %9.2f us  %7.2f MB  %6.2f TB/s  ratio to copy %.3f\n",
                c.name, c.tokens, c.heads, c.keys, kernel, splits, us, bytes / 1e6, bytes / (us * 1e-6) / 1e12,
                bytes / (us * 1e-6) / copy_bw);
    std::fflush(stdout);
  };
  const MlaDecodePlan automatic = PlanMlaDecode(copies[0].p, num_sms);
  print("split", automatic.splits, TimeCase(copies, Kernel::kSplit, 0, num_sms, stream, scratch));
  if (sweep) {
    for (int s : {8, 16, 32, 64, 96, 128, 132, 192, 256}) {
      print("split", s, TimeCase(copies, Kernel::kSplit, s, num_sms, stream, scratch));
    }
  }
  if (c.keys <= 4096 && c.tokens == 1) {
    std::vector<Instance> few(copies.begin(), copies.begin() + std::min(n, 4));
    print("per-head", 0, TimeCase(few, Kernel::kPerHead, 0, num_sms, stream, scratch));
  }
  for (Instance& in : copies) {
    for (void* p : in.owned) BENCH_CHECK(cudaFree(p));
  }
  for (void* s : scratch) BENCH_CHECK(cudaFree(s));
}

}  // namespace
}  // namespace nq::kernels::cuda

int main(int argc, char** argv) {
  using namespace nq::kernels::cuda;
  const bool sweep = argc > 1 && std::strcmp(argv[1], "--sweep") == 0;
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  // --only SUBSTRING (after the mode, or alone): the cases whose name holds it.
  std::string only;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--only") == 0) only = argv[i + 1];
  }
  const nq::bench::BenchDevice d = nq::bench::OpenBenchDevice();
  // One tensor-parallel rank of DeepSeek-V3 (16 heads) and the whole model on one GPU (128).
  const Case cases[] = {
      {"dsv3-rank dense", 1, 16, 4096, 0},      {"dsv3-rank dense", 1, 16, 32768, 0},
      {"dsv3-rank DSA 2048", 1, 16, 4096, 2048}, {"dsv3-rank DSA 2048", 1, 16, 32768, 2048},
      {"dsv3-rank dense MTP", 4, 16, 4096, 0},  {"dsv3-rank dense MTP", 4, 16, 32768, 0},
      {"dsv3 all heads dense", 1, 128, 4096, 0}, {"dsv3 all heads dense", 1, 128, 32768, 0},
      {"dsv3-rank dense bf16 kv", 1, 16, 4096, 0, Cache::kBf16},
      {"dsv3-rank dense bf16 kv", 1, 16, 32768, 0, Cache::kBf16},
      {"dsv3-rank DSA bf16 kv", 1, 16, 32768, 2048, Cache::kBf16},
      {"dsv3-rank MTP bf16 kv", 4, 16, 32768, 0, Cache::kBf16},
      {"dsv3 all heads bf16 kv", 1, 128, 32768, 0, Cache::kBf16},
      {"dsv3-rank dense fp8 kv", 1, 16, 4096, 0, Cache::kFp8},
      {"dsv3-rank dense fp8 kv", 1, 16, 32768, 0, Cache::kFp8},
      {"dsv3-rank DSA fp8 kv", 1, 16, 32768, 2048, Cache::kFp8},
      {"dsv3-rank MTP fp8 kv", 4, 16, 32768, 0, Cache::kFp8},
      {"dsv3 all heads fp8 kv", 1, 128, 32768, 0, Cache::kFp8},
      // GLM-5 on one GPU (64 heads, dn 192, dv 256) at the decode slice's context (issue #13).
      {"glm5 DSA 2048", 1, 64, 4096, 2048, Cache::kF32, 192, 256},
      {"glm5 DSA 2048 bf16 kv", 1, 64, 4096, 2048, Cache::kBf16, 192, 256},
      {"glm5 DSA 2048 fp8 kv", 1, 64, 4096, 2048, Cache::kFp8, 192, 256},
      {"glm5 DSA 2048 MTP", 4, 64, 4096, 2048, Cache::kF32, 192, 256},
  };
  for (const Case& c : cases) {
    if (!only.empty() && std::string(c.name).find(only) == std::string::npos) continue;
    RunCase(c, d.copy_bw, d.num_sms, d.stream, sweep);
    if (quick) break;
  }
  BENCH_CHECK(cudaStreamDestroy(d.stream));
  return 0;
}
