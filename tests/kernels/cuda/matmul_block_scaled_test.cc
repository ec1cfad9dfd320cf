// CUDA MatMulBlockScaled (FP8 E4M3 weights, 128 x 128 block scales) vs the CPU backend: the GEMV
// for every m up to 8 (16-byte and scalar paths), the tiled kernel beyond, ragged n and k, NaN
// weights, and the refusal of CPU tensors.
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomE4M3;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadBytes;
using ::testing::HasSubstr;

// As CudaMatMul: fp32 sums of up to ~7000 terms in another order than the CPU, plus one rounding
// of x * scale (GEMV) where the CPU rounds w * scale: ~1e-6 expected.
constexpr double kTolerance = 1e-4;
constexpr std::int64_t kBlock = 128;

std::int64_t Blocks(std::int64_t d) { return (d + kBlock - 1) / kBlock; }

struct Dims {
  std::int64_t m, n, k;
};

struct Fp8Weight {
  std::vector<std::uint8_t> bytes;  // [n, k]
  std::vector<float> scales;        // [ceil(n / 128), ceil(k / 128)]
};

// Every finite E4M3 pattern; scales a few binades apart block to block, as checkpoints have them.
Fp8Weight RandomWeight(std::mt19937_64& rng, const Dims& d) {
  Fp8Weight w{.bytes = RandomE4M3(rng, d.n * d.k, /*allow_nan=*/false),
              .scales = RandomUniform(rng, Blocks(d.n) * Blocks(d.k), 0.5f, 1.0f)};
  for (float& s : w.scales) s = std::ldexp(s, static_cast<int>(RandomInt(rng, -12, -4)));
  return w;
}

// y on the CPU (outputs[0]) and CUDA (outputs[1]) backends from the same inputs.
void RunBoth(const std::vector<float>& x, const Fp8Weight& w, const Dims& d,
             std::vector<float> (&outputs)[2]) {
  int i = 0;
  for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
    Tensor tx = Upload(*backend, x, DType::kF32, {d.m, d.k});
    Tensor tw = UploadBytes(*backend, w.bytes, DType::kF8E4M3, {d.n, d.k});
    Tensor ts = Upload(*backend, w.scales, DType::kF32, {Blocks(d.n), Blocks(d.k)});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {d.m, d.n});
    const absl::Status status = backend->MatMulBlockScaled(tx, tw, ts, ty);
    EXPECT_TRUE(status.ok()) << backend->name() << ": " << status;
    outputs[i++] = Download(*backend, ty);
  }
}

TEST(CudaMatMulBlockScaled, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1131);
  std::vector<Dims> cases = {
      // DeepSeek-V3 shapes at decode: 16-byte path, whole scale blocks.
      {1, 7168, 7168}, {4, 2112, 7168}, {8, 7168, 2048}, {1, 1536, 18432},
      // Tiled path (m > 8), ragged in every dimension.
      {9, 130, 129}, {64, 300, 520}, {200, 257, 1000}};
  // Every GEMV instantiation: n not a multiple of a block's 32 rows nor of 128, k odd (scalar
  // path), k a multiple of 16 that ends inside a scale block and spans several staged x chunks.
  for (std::int64_t m = 1; m <= 8; ++m) {
    cases.push_back({m, 77, 1001});
    cases.push_back({m, 161, 2080});
  }
  cases.push_back({1, 40, 9008});  // m = 1 stages x in 8192-column chunks
  // The tensor-core GEMV (k a multiple of 16): k inside one 128-column step, a step and a vector,
  // a 512-column round and a vector; rows ending mid-tile.
  for (std::int64_t m : {1, 4, 5, 8}) {
    cases.push_back({m, 40, 16});
    cases.push_back({m, 23, 144});
    cases.push_back({m, 300, 528});
  }
  // Few rows: k split over a cluster (GemvSplits); at k = 6150 (scalar path) split boundaries
  // fall inside scale blocks.
  cases.push_back({1, 576, 7168});
  cases.push_back({4, 64, 7168});
  cases.push_back({3, 130, 6150});
  for (int i = 0; i < 4; ++i) {
    cases.push_back({RandomInt(rng, 1, 40), RandomInt(rng, 1, 700), RandomInt(rng, 1, 1500)});
  }
  ErrorSummary summary("MatMulBlockScaled", kTolerance);
  for (const Dims& d : cases) {
    SCOPED_TRACE(absl::StrCat("m=", d.m, " n=", d.n, " k=", d.k));
    const std::vector<float> x = RandomNormal(rng, d.m * d.k, 1.0f);
    std::vector<float> outputs[2];
    RunBoth(x, RandomWeight(rng, d), d, outputs);
    summary.Add(NormalizedError(outputs[1], outputs[0]));
  }
}

// The tensor-core GEMV takes x as f16 hi + lo, each 128-column step of a token scaled by a power
// of two into f16's range: inputs over twelve decades (1e-6 .. 1e6, past f16's 65504 and below
// its normal range) keep fp32 accuracy, for every m.
TEST(CudaMatMulBlockScaled, GemvKeepsFp32AccuracyOverWideInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1133);
  ErrorSummary summary("MatMulBlockScaled, x over 1e-6 .. 1e6", kTolerance);
  for (std::int64_t m = 1; m <= 8; ++m) {
    SCOPED_TRACE(absl::StrCat("m=", m));
    const Dims d{m, 1000, 4096};
    std::vector<float> x = RandomNormal(rng, d.m * d.k, 1.0f);
    // Whole steps of tiny or huge values, and single outliers among ordinary ones.
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::int64_t step = static_cast<std::int64_t>(i) / 128;
      const int decade = step % 5 == 1 ? -6 : step % 5 == 3 ? 6 : static_cast<int>(RandomInt(rng, -3, 3));
      x[i] *= std::pow(10.0f, static_cast<float>(decade));
    }
    std::vector<float> outputs[2];
    RunBoth(x, RandomWeight(rng, d), d, outputs);
    summary.Add(NormalizedError(outputs[1], outputs[0]));
  }
}

// A token's outputs must not depend on how many tokens share the pass (MTP verification equals
// plain decoding), on both GEMV kernels and with k split over a cluster.
TEST(CudaMatMulBlockScaled, GemvRowsAreBitIdenticalWhateverTheTokenCount) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(1134);
  for (const Dims& d : {Dims{8, 576, 7168}, Dims{8, 4096, 4096}, Dims{8, 100, 1008}, Dims{8, 100, 1001}}) {
    SCOPED_TRACE(absl::StrCat("n=", d.n, " k=", d.k));
    const std::vector<float> x = RandomNormal(rng, d.m * d.k, 1.0f);
    const Fp8Weight fp8 = RandomWeight(rng, d);
    Tensor w = UploadBytes(cuda, fp8.bytes, DType::kF8E4M3, {d.n, d.k});
    Tensor scales = Upload(cuda, fp8.scales, DType::kF32, {Blocks(d.n), Blocks(d.k)});
    Tensor all = AllocateOrFail(cuda, DType::kF32, {d.m, d.n});
    NQ_ASSERT_OK(cuda.MatMulBlockScaled(Upload(cuda, x, DType::kF32, {d.m, d.k}), w, scales, all));
    const std::vector<float> together = Download(cuda, all);
    for (std::int64_t m : {1, 3}) {
      const std::vector<float> first(x.begin(), x.begin() + m * d.k);
      Tensor fewer = AllocateOrFail(cuda, DType::kF32, {m, d.n});
      NQ_ASSERT_OK(cuda.MatMulBlockScaled(Upload(cuda, first, DType::kF32, {m, d.k}), w, scales, fewer));
      EXPECT_EQ(Download(cuda, fewer), std::vector<float>(together.begin(), together.begin() + m * d.n))
          << m << " tokens differ from the same tokens among " << d.m;
    }
  }
}

TEST(CudaMatMulBlockScaled, NanWeightPoisonsOnlyItsOutputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1132);
  for (const Dims& d : {Dims{3, 70, 256}, Dims{3, 70, 250}, Dims{12, 70, 256}}) {
    SCOPED_TRACE(absl::StrCat("m=", d.m, " n=", d.n, " k=", d.k));
    Fp8Weight w = RandomWeight(rng, d);
    w.bytes[5 * d.k + 130] = 0x7f;  // NaN in row 5, second scale block
    std::vector<float> outputs[2];
    RunBoth(RandomNormal(rng, d.m * d.k, 1.0f), w, d, outputs);
    const std::vector<float>& y = outputs[1];
    for (std::int64_t i = 0; i < d.m; ++i) {
      for (std::int64_t j = 0; j < d.n; ++j) {
        ASSERT_EQ(std::isnan(y[i * d.n + j]), j == 5) << "y[" << i << ", " << j << "]";
      }
    }
  }
}

TEST(CudaMatMulBlockScaled, EmptyKGivesZeros) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Tensor x = AllocateOrFail(cuda, DType::kF32, {3, 0});
  Tensor w = AllocateOrFail(cuda, DType::kF8E4M3, {40, 0});
  Tensor scale = AllocateOrFail(cuda, DType::kF32, {1, 0});
  Tensor y = Upload(cuda, std::vector<float>(3 * 40, 3.0f), DType::kF32, {3, 40});
  NQ_ASSERT_OK(cuda.MatMulBlockScaled(x, w, scale, y));
  EXPECT_THAT(Download(cuda, y), ::testing::Each(0.0f));
}

TEST(CudaMatMulBlockScaled, RejectsCpuScales) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Tensor x = AllocateOrFail(cuda, DType::kF32, {2, 128});
  Tensor w = AllocateOrFail(cuda, DType::kF8E4M3, {4, 128});
  Tensor scale = AllocateOrFail(*Backends().cpu, DType::kF32, {1, 1});
  Tensor y = AllocateOrFail(cuda, DType::kF32, {2, 4});
  EXPECT_THAT(cuda.MatMulBlockScaled(x, w, scale, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMulBlockScaled: scale_inv F32[1, 1] belongs to another "
                                 "backend")));
}

}  // namespace
}  // namespace nq::kernels
