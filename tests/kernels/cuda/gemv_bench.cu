// gemv_bench: the dense decode GEMV (MatMul for 1-8 tokens, kernels/cuda/matmul_gemv.cuh) at the
// projection shapes of GLM-5 and DeepSeek-V3, BF16 weights, with k split as GemvSplits chooses
// and at every forced split count (bench/README.md; issue #13). A measurement, not a test: one
// line per case with microseconds per call and the bytes it must read (weights, x, y) over the
// device-to-device copy bandwidth measured in the same run.
//
// Each case cycles through enough copies of its weight that none stays in the 50 MB L2 between
// calls (as consecutive layers would); a CUDA graph of one call per copy is replayed.
//
// Each case runs on both BF16 kernels side by side (MatMulParams::gemv_kernel): the tensor cores
// (MatMulGemvMmaKernel) and fp32 FMAs (MatMulGemvKernel); "<" marks the one LaunchMatMul picks
// (MmaGemvPays). Then FP8 weights (the FMA kernel).
//
// Then the shared-input groups (MatMulSharedInput): a decode step's projections of one input in
// one launch against one launch each.
//
//   gemv_bench [--quick]   (--quick: automatic splits only)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/matmul_gemv_mma.cuh"
#include "tests/kernels/cuda/bench_util.h"

namespace nq::kernels::cuda {
namespace {

using ::nq::bench::CopyBandwidth;
using ::nq::bench::GraphReplayMicros;

constexpr std::size_t kColdBytes = std::size_t{400} << 20;  // 8x the L2

struct Shape {
  const char* name;
  int n, k;
};

constexpr Shape kShapes[] = {
    {"GLM-5 q_a", 2048, 6144},           {"GLM-5 kv_a", 512, 6144},
    {"GLM-5 k_pe", 64, 6144},            {"GLM-5 q_nope", 12288, 2048},
    {"GLM-5 q_pe / idx wq_b", 4096, 2048}, {"GLM-5 o_proj", 6144, 16384},
    {"GLM-5 idx wk", 128, 6144},         {"GLM-5 idx weights", 32, 6144},
    {"GLM-5 dense gate+up", 24576, 6144}, {"GLM-5 dense down", 6144, 12288},
    {"slice lm_head", 8192, 6144},       {"DSv3 q_a", 1536, 7168},
    {"DSv3 q_b", 24576, 1536},           {"DSv3 o_proj", 7168, 16384},
    {"DSv3 dense down", 7168, 18432},    {"DSv3 lm_head", 129280, 7168},
};

// Microseconds per call of `p` over `copies` weights `stride` bytes apart, from a graph replay.
double MicrosPerCall(MatMulParams p, const std::uint8_t* weights, std::size_t stride, int copies,
                     const LaunchContext& ctx) {
  return GraphReplayMicros(ctx.stream, 10, [&] {
           for (int c = 0; c < copies; ++c) {
             p.w = weights + c * stride;
             BENCH_OK(LaunchMatMul(p, ctx));
           }
         }) / copies;
}

// Projections of one input, as the model runs them through MatMulSharedInput: one launch
// (MatMulParams::extra) against one launch per matrix, in the same run.
struct SharedGroup {
  const char* name;
  int k;
  std::vector<int> rows;
};

// Microseconds per group call, every matrix's weights at `weights` + c * stride + its offset.
double MicrosPerGroup(const SharedGroup& g, bool together, bool fma, int m, const std::uint8_t* weights,
                      std::size_t stride, int copies, float* y, const float* x, const LaunchContext& ctx) {
  return GraphReplayMicros(ctx.stream, 10, [&] {
           for (int c = 0; c < copies; ++c) {
             const std::uint8_t* at = weights + c * stride;
             float* out = y;
             MatMulParams p{.x = x, .w = at, .w_dtype = DType::kBF16, .y = out, .m = m, .n = g.rows[0], .k = g.k,
                            .gemv_kernel = fma ? DecodeGemv::kFp32Fma : DecodeGemv::kTensorCores};
             for (std::size_t i = 1; i < g.rows.size(); ++i) {
               at += static_cast<std::size_t>(g.rows[i - 1]) * g.k * 2;
               out += static_cast<std::size_t>(m) * g.rows[i - 1];
               if (together) {
                 p.extra[p.num_extra++] = MatMulExtra{.w = at, .y = out, .n = g.rows[i]};
               } else {
                 BENCH_OK(LaunchMatMul(p, ctx));
                 p.w = at;
                 p.y = out;
                 p.n = g.rows[i];
               }
             }
             BENCH_OK(LaunchMatMul(p, ctx));
           }
         }) / copies;
}

void RunSharedGroups(const nq::bench::DeviceBytes& weights, const nq::bench::DeviceBytes& x,
                     const nq::bench::DeviceBytes& y, double copy, const LaunchContext& ctx) {
  const SharedGroup groups[] = {
      {"GLM-5 x: q_a kv_a k_pe wk w", 6144, {2048, 512, 64, 128, 32}},
      {"GLM-5 q: q_nope q_pe wq_b", 2048, {12288, 4096, 4096}},
      {"DSv3 x: q_a kv_a k_pe", 7168, {1536, 512, 64}},
  };
  std::printf("\n%-30s %2s %-6s %12s %8s %12s %8s %8s\n", "shared input", "m", "kernel", "apart us", "/ copy",
              "together us", "/ copy", "speedup");
  for (const SharedGroup& g : groups) {
    std::size_t bytes = 0, rows = 0;
    for (int n : g.rows) {
      bytes += static_cast<std::size_t>(n) * g.k * 2;
      rows += static_cast<std::size_t>(n);
    }
    const std::size_t stride = (bytes + 255) / 256 * 256;
    const int copies = static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(64, kColdBytes / stride + 1)));
    for (int m : {1, 4}) {
      for (bool fma : {false, true}) {
        const double moved = static_cast<double>(bytes) + 4.0 * m * (g.k + static_cast<double>(rows));
        const auto* w = static_cast<const std::uint8_t*>(weights.p);
        const double apart = MicrosPerGroup(g, false, fma, m, w, stride, copies, static_cast<float*>(y.p),
                                            static_cast<const float*>(x.p), ctx);
        const double together = MicrosPerGroup(g, true, fma, m, w, stride, copies, static_cast<float*>(y.p),
                                               static_cast<const float*>(x.p), ctx);
        std::printf("%-30s %2d %-6s %12.2f %8.3f %12.2f %8.3f %8.2f\n", g.name, m, fma ? "fma" : "tensor", apart,
                    moved / (apart * 1e-6) / copy, together, moved / (together * 1e-6) / copy, apart / together);
      }
    }
  }
}

int Main(bool quick) {
  int device = 0, num_sms = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  BENCH_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const LaunchContext ctx{.stream = stream, .num_sms = num_sms};
  const double copy = CopyBandwidth();
  std::printf("gemv_bench: %d SMs, copy %.0f GB/s (read + write)\n", num_sms, copy / 1e9);
  std::printf("%-24s %6s %6s %2s %-6s %6s %9s %8s %7s\n", "shape", "n", "k", "m", "kernel", "splits", "us", "GB/s",
              "/ copy");

  const std::size_t most = static_cast<std::size_t>(129280) * 7168 * 2;
  nq::bench::DeviceBytes weights(kColdBytes + most);
  BENCH_CHECK(cudaMemset(weights.p, 0x3c, kColdBytes + most));  // bf16 ~ 0.0115, finite
  nq::bench::DeviceBytes x(8 * 32768 * sizeof(float)), y(8 * 131072 * sizeof(float));
  BENCH_CHECK(cudaMemset(x.p, 0, 8 * 32768 * sizeof(float)));

  for (const Shape& s : kShapes) {
    const std::size_t bytes = static_cast<std::size_t>(s.n) * s.k * 2;
    const std::size_t stride = (bytes + 255) / 256 * 256;
    const int copies = static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(64, kColdBytes / stride + 1)));
    for (int m : {1, 2, 4, 8}) {
      for (bool fma : {false, true}) {
        // The column steps GemvSplits sees: 128 columns for the tensor cores, 256 for FMAs.
        const int row_blocks = (s.n + kGemvRowsPerBlock - 1) / kGemvRowsPerBlock;
        const int step = fma ? kWarpSize * 8 : kMmaGemvStepCols;
        const int chosen = GemvSplits(row_blocks, (s.k + step - 1) / step, num_sms);
        std::vector<int> forced = {0};
        if (!quick) forced.insert(forced.end(), {1, 2, 4, 8});
        for (int f : forced) {
          if (f > 0 && f == chosen) continue;
          MatMulParams p{.x = static_cast<const float*>(x.p), .w = nullptr, .w_dtype = DType::kBF16,
                         .y = static_cast<float*>(y.p), .m = m, .n = s.n, .k = s.k, .k_splits = f,
                         .gemv_kernel = fma ? DecodeGemv::kFp32Fma : DecodeGemv::kTensorCores};
          const double us = MicrosPerCall(p, static_cast<const std::uint8_t*>(weights.p), stride, copies, ctx);
          const double moved = static_cast<double>(bytes) + 4.0 * m * (s.k + s.n);
          const double rate = moved / (us * 1e-6);
          const bool picked = fma != MmaGemvPays(row_blocks, num_sms);
          std::printf("%-24s %6d %6d %2d %-6s %5d%s %9.2f %8.0f %7.3f%s\n", s.name, s.n, s.k, m, fma ? "fma" : "tensor",
                      f > 0 ? f : chosen, f > 0 ? " " : "*", us, rate / 1e9, rate / copy, picked ? " <" : "");
        }
      }
    }
  }
  std::printf("(* = the split count GemvSplits chooses)\n");

  // FP8 (E4M3, 128 x 128 block scales) at the shapes of FP8 checkpoints' large projections.
  const std::size_t scale_bytes = static_cast<std::size_t>(129280 / 128 + 1) * (18432 / 128 + 1) * sizeof(float);
  nq::bench::DeviceBytes scales(scale_bytes);
  BENCH_CHECK(cudaMemset(scales.p, 0, scale_bytes));  // zero scales: finite products, the same bytes read
  std::printf("\nFP8 E4M3 weights (the FMA kernel)\n%-24s %6s %6s %2s %9s %8s %7s\n", "shape", "n", "k", "m", "us",
              "GB/s", "/ copy");
  for (const Shape& s : kShapes) {
    const std::size_t bytes = static_cast<std::size_t>(s.n) * s.k;
    const std::size_t stride = (bytes + 255) / 256 * 256;
    const int copies = static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(64, kColdBytes / stride + 1)));
    for (int m : {1, 4, 8}) {
      MatMulParams p{.x = static_cast<const float*>(x.p), .w = nullptr, .w_dtype = DType::kF8E4M3,
                     .w_scale = static_cast<const float*>(scales.p), .y = static_cast<float*>(y.p), .m = m, .n = s.n,
                     .k = s.k};
      const double us = MicrosPerCall(p, static_cast<const std::uint8_t*>(weights.p), stride, copies, ctx);
      const double moved = static_cast<double>(bytes) + 4.0 * m * (s.k + s.n);
      const double rate = moved / (us * 1e-6);
      std::printf("%-24s %6d %6d %2d %9.2f %8.0f %7.3f\n", s.name, s.n, s.k, m, us, rate / 1e9, rate / copy);
    }
  }
  RunSharedGroups(weights, x, y, copy, ctx);
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace nq::kernels::cuda

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  return nq::kernels::cuda::Main(quick);
}
