// Throughput of the CUDA ops on large shapes, printed next to a device-to-device copy measured in
// the same run, so each memory-bound op reads as a fraction of what the memory system delivered.
// Informational: it fails only if an op returns an error.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomE4M3;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadBytes;
using ::nq::kernels::testing::UploadI32;

// H200 SXM fp32 (non-tensor) peak from NVIDIA's datasheet; a reference line, not a measurement.
constexpr double kDatasheetFp32Tflops = 67.0;
constexpr double kMinSeconds = 0.2;
constexpr int kWarmup = 3;

// Seconds per call of `op`, by wall clock over back-to-back calls bracketed by Synchronize, for
// at least kMinSeconds after kWarmup calls. Returns a negative value if an op fails.
double SecondsPerCall(Backend& backend, const std::function<absl::Status()>& op) {
  for (int i = 0; i < kWarmup; ++i) {
    const absl::Status status = op();
    if (!status.ok()) {
      ADD_FAILURE() << status;
      return -1.0;
    }
  }
  if (const absl::Status status = backend.Synchronize(); !status.ok()) {
    ADD_FAILURE() << status;
    return -1.0;
  }
  using Clock = std::chrono::steady_clock;
  int calls = 0;
  int batch = 1;
  const Clock::time_point start = Clock::now();
  double elapsed = 0.0;
  while (elapsed < kMinSeconds) {
    for (int i = 0; i < batch; ++i) {
      if (const absl::Status status = op(); !status.ok()) {
        ADD_FAILURE() << status;
        return -1.0;
      }
    }
    if (const absl::Status status = backend.Synchronize(); !status.ok()) {
      ADD_FAILURE() << status;
      return -1.0;
    }
    calls += batch;
    batch *= 2;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return elapsed / calls;
}

// Random values, drawn for the first 2^20 elements and repeated after that: timing needs realistic
// values (not zeros), not 10^8 fresh draws on the host.
Tensor RandomTensor(Backend& backend, std::mt19937_64& rng, DType dtype, Shape shape, float sd) {
  constexpr std::size_t kDrawn = std::size_t{1} << 20;
  const std::size_t count = static_cast<std::size_t>(shape.NumElements());
  std::vector<float> values = RandomNormal(rng, std::min(count, kDrawn), sd);
  values.resize(count);
  for (std::size_t i = kDrawn; i < count; ++i) values[i] = values[i - kDrawn];
  return Upload(backend, values, dtype, std::move(shape));
}

// Random finite E4M3 bytes, drawn for the first 2^20 and repeated, as RandomTensor.
Tensor RandomE4M3Tensor(Backend& backend, std::mt19937_64& rng, Shape shape) {
  constexpr std::size_t kDrawn = std::size_t{1} << 20;
  const std::size_t count = static_cast<std::size_t>(shape.NumElements());
  std::vector<std::uint8_t> bytes = RandomE4M3(rng, std::min(count, kDrawn), /*allow_nan=*/false);
  bytes.resize(count);
  for (std::size_t i = kDrawn; i < count; ++i) bytes[i] = bytes[i - kDrawn];
  return UploadBytes(backend, bytes, DType::kF8E4M3, std::move(shape));
}

void PrintBandwidth(const std::string& what, double bytes, double seconds, double copy_gbps) {
  const double gbps = bytes / seconds / 1e9;
  std::printf("[  timing  ] %-40s %9.3f ms %8.0f GB/s  %5.2f x copy\n", what.c_str(),
              seconds * 1e3, gbps, gbps / copy_gbps);
}

TEST(CudaTiming, PrintsThroughputAgainstDeviceCopy) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(1501);

  // Device-to-device copy of 1 GiB; bytes counted read + written.
  constexpr std::int64_t kCopyFloats = std::int64_t{1} << 28;
  Tensor src = AllocateOrFail(cuda, DType::kF32, {kCopyFloats});
  Tensor dst = AllocateOrFail(cuda, DType::kF32, {kCopyFloats});
  const double copy_s = SecondsPerCall(cuda, [&] { return cuda.Copy(src, dst); });
  ASSERT_GT(copy_s, 0.0);
  const double copy_bytes = 2.0 * src.nbytes();
  const double copy_gbps = copy_bytes / copy_s / 1e9;
  std::printf("[  timing  ] %-40s %9.3f ms %8.0f GB/s  (read + write; the yardstick)\n",
              "cudaMemcpy D2D 1 GiB", copy_s * 1e3, copy_gbps);

  // Prefill GEMMs: compute-bound.
  for (DType w_dtype : {DType::kF32, DType::kBF16}) {
    constexpr std::int64_t kM = 4096, kN = 4096, kK = 4096;
    Tensor x = RandomTensor(cuda, rng, DType::kF32, {kM, kK}, 1.0f);
    Tensor w = RandomTensor(cuda, rng, w_dtype, {kN, kK}, 0.02f);
    Tensor y = AllocateOrFail(cuda, DType::kF32, {kM, kN});
    const double s = SecondsPerCall(cuda, [&] { return cuda.MatMul(x, w, y); });
    ASSERT_GT(s, 0.0);
    const double tflops = 2.0 * kM * kN * kK / s / 1e12;
    std::printf("[  timing  ] %-40s %9.3f ms %8.2f TFLOP/s (%.0f%% of the %.0f fp32 datasheet)\n",
                (std::string("MatMul ") + DTypeName(w_dtype) + " 4096x4096x4096").c_str(),
                s * 1e3, tflops, 100.0 * tflops / kDatasheetFp32Tflops, kDatasheetFp32Tflops);
  }

  // Decode GEMVs: memory-bound, so bytes (weights + x + y) against the copy.
  struct Gemv {
    std::int64_t m, n, k;
    DType w_dtype;
  };
  for (const Gemv& g : {Gemv{1, 7168, 7168, DType::kBF16}, Gemv{1, 18432, 7168, DType::kBF16},
                        Gemv{4, 18432, 7168, DType::kBF16}, Gemv{1, 7168, 7168, DType::kF32},
                        Gemv{2, 18432, 7168, DType::kBF16}, Gemv{8, 18432, 7168, DType::kBF16},
                        Gemv{4, 7168, 7168, DType::kBF16}, Gemv{4, 7168, 18432, DType::kBF16},
                        Gemv{4, 18432, 7168, DType::kF16}, Gemv{4, 7168, 7168, DType::kF32}}) {
    Tensor x = RandomTensor(cuda, rng, DType::kF32, {g.m, g.k}, 1.0f);
    Tensor w = RandomTensor(cuda, rng, g.w_dtype, {g.n, g.k}, 0.02f);
    Tensor y = AllocateOrFail(cuda, DType::kF32, {g.m, g.n});
    const double s = SecondsPerCall(cuda, [&] { return cuda.MatMul(x, w, y); });
    ASSERT_GT(s, 0.0);
    const double bytes = static_cast<double>(w.nbytes() + x.nbytes() + y.nbytes());
    PrintBandwidth(std::string("MatMul GEMV ") + DTypeName(g.w_dtype) + " " + std::to_string(g.m) +
                       "x" + std::to_string(g.n) + "x" + std::to_string(g.k),
                   bytes, s, copy_gbps);
  }

  // FP8 (E4M3, 128 x 128 block scales) decode GEMVs: bytes are weights + scales + x + y.
  for (const std::int64_t m : {1, 4, 8}) {
    constexpr std::int64_t kN = 18432, kK = 7168;
    Tensor x = RandomTensor(cuda, rng, DType::kF32, {m, kK}, 1.0f);
    Tensor w = RandomE4M3Tensor(cuda, rng, {kN, kK});
    Tensor scale = RandomTensor(cuda, rng, DType::kF32, {kN / 128, kK / 128}, 1e-3f);
    Tensor y = AllocateOrFail(cuda, DType::kF32, {m, kN});
    const double s = SecondsPerCall(cuda, [&] { return cuda.MatMulBlockScaled(x, w, scale, y); });
    ASSERT_GT(s, 0.0);
    const double bytes =
        static_cast<double>(w.nbytes() + scale.nbytes() + x.nbytes() + y.nbytes());
    PrintBandwidth("MatMul GEMV F8_E4M3 " + std::to_string(m) + "x" + std::to_string(kN) + "x" +
                       std::to_string(kK),
                   bytes, s, copy_gbps);
  }

  // Row ops over a large prefill chunk: 16384 tokens of DeepSeek-V3's 7168-wide hidden state.
  {
    constexpr std::int64_t kRows = 16384, kCols = 7168;
    Tensor x = RandomTensor(cuda, rng, DType::kF32, {kRows, kCols}, 1.0f);
    Tensor w = RandomTensor(cuda, rng, DType::kBF16, {kCols}, 1.0f);
    Tensor y = AllocateOrFail(cuda, DType::kF32, {kRows, kCols});
    const double s = SecondsPerCall(cuda, [&] { return cuda.RmsNorm(x, w, 1e-6f, y); });
    ASSERT_GT(s, 0.0);
    PrintBandwidth("RmsNorm 16384x7168 (BF16 weight)",
                   static_cast<double>(x.nbytes() + y.nbytes() + w.nbytes()), s, copy_gbps);
  }
  {
    constexpr std::int64_t kRows = 16384, kD = 4096;
    Tensor x = RandomTensor(cuda, rng, DType::kF32, {kRows, 2 * kD}, 2.0f);
    Tensor y = AllocateOrFail(cuda, DType::kF32, {kRows, kD});
    const double s = SecondsPerCall(cuda, [&] { return cuda.SiluAndMul(x, y); });
    ASSERT_GT(s, 0.0);
    PrintBandwidth("SiluAndMul 16384x(2x4096)", static_cast<double>(x.nbytes() + y.nbytes()), s,
                   copy_gbps);
  }
  {
    constexpr std::int64_t kRows = 2048, kCols = 129280;
    Tensor x = RandomTensor(cuda, rng, DType::kF32, {kRows, kCols}, 4.0f);
    Tensor y = AllocateOrFail(cuda, DType::kF32, {kRows, kCols});
    const double s = SecondsPerCall(cuda, [&] { return cuda.Softmax(x, 1.0f, y); });
    ASSERT_GT(s, 0.0);
    PrintBandwidth("Softmax 2048x129280", static_cast<double>(x.nbytes() + y.nbytes()), s,
                   copy_gbps);
  }

  // Attention for one tensor-parallel rank of DeepSeek-V3.2 (16 heads; dn 128, dr 64, c 512,
  // dv 128; BF16 absorbed weights), one decode token over a 4096-token latent cache: dense, and
  // with a 2048-key DSA selection. Bytes: the cache and the weights, each counted once (the
  // kernel re-reads the cache per head from L2).
  {
    constexpr std::int64_t kHeads = 16, kDn = 128, kDr = 64, kC = 512, kDv = 128, kKeys = 4096;
    constexpr std::int64_t kTopK = 2048;
    Tensor q_nope = RandomTensor(cuda, rng, DType::kF32, {1, kHeads, kDn}, 1.0f);
    Tensor q_pe = RandomTensor(cuda, rng, DType::kF32, {1, kHeads, kDr}, 1.0f);
    Tensor kv = RandomTensor(cuda, rng, DType::kF32, {kKeys, kC}, 1.0f);
    Tensor k_pe = RandomTensor(cuda, rng, DType::kF32, {kKeys, kDr}, 1.0f);
    Tensor w_uk = RandomTensor(cuda, rng, DType::kBF16, {kHeads, kDn, kC}, 0.05f);
    Tensor w_uv = RandomTensor(cuda, rng, DType::kBF16, {kHeads, kDv, kC}, 0.05f);
    Tensor out = AllocateOrFail(cuda, DType::kF32, {1, kHeads * kDv});
    std::vector<std::int32_t> keys(kTopK);
    for (std::int64_t i = 0; i < kTopK; ++i) keys[i] = static_cast<std::int32_t>(2 * i);
    Tensor selected = UploadI32(cuda, keys, {1, kTopK});
    const double bytes =
        static_cast<double>(kv.nbytes() + k_pe.nbytes() + w_uk.nbytes() + w_uv.nbytes());
    const Tensor* const dense = nullptr;
    for (const Tensor* sel : {dense, static_cast<const Tensor*>(&selected)}) {
      const double s = SecondsPerCall(cuda, [&] {
        return cuda.MlaAttention(q_nope, q_pe, kv, k_pe, w_uk, w_uv, sel, kKeys - 1, 0.0722f, out);
      });
      ASSERT_GT(s, 0.0);
      PrintBandwidth(sel == nullptr ? "MlaAttention decode 16h x 4096 keys"
                                    : "MlaAttention decode 16h, DSA 2048 of 4096",
                     bytes, s, copy_gbps);
    }
  }
  // DSA indexer for one decode token: 64 heads of 128 over 16384 and 131072 keys, top 2048.
  for (const std::int64_t keys : {std::int64_t{16384}, std::int64_t{131072}}) {
    constexpr std::int64_t kHeads = 64, kDim = 128, kTopK = 2048;
    Tensor q = RandomTensor(cuda, rng, DType::kF32, {1, kHeads, kDim}, 1.0f);
    Tensor k = RandomTensor(cuda, rng, DType::kF32, {keys, kDim}, 1.0f);
    Tensor w = RandomTensor(cuda, rng, DType::kF32, {1, kHeads}, 0.1f);
    Tensor selected = AllocateOrFail(cuda, DType::kI32, {1, kTopK});
    const double s = SecondsPerCall(
        cuda, [&] { return cuda.IndexerTopK(q, k, w, keys - 1, selected); });
    ASSERT_GT(s, 0.0);
    PrintBandwidth("IndexerTopK decode 64h x " + std::to_string(keys) + " keys, top 2048",
                   static_cast<double>(k.nbytes() + q.nbytes()), s, copy_gbps);
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace nq::kernels
