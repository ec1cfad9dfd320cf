// CUDA MatMul vs the CPU backend on fresh random inputs: GEMV (each m up to 8) and both tile
// shapes, sizes that are not multiples of the tiles or of the 16-byte vectors, F32 / BF16 / F16
// weights.
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/matmul_params.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::DecodeGemvBackends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

// fp32 FMA chains of up to 7168 terms in a different order than the CPU: ~1e-6 expected.
constexpr double kTolerance = 1e-4;

struct Dims {
  std::int64_t m, n, k;
};

// DecodeGemvBackends()' order.
constexpr const char* kGemvNames[] = {" (automatic GEMV)", " (tensor-core GEMV)", " (fp32-FMA GEMV)"};

// y = x · w^T on the CPU and `cuda` from the same inputs; the normalised CUDA-vs-CPU error.
double CompareMatMul(std::mt19937_64& rng, const Dims& d, DType w_dtype, Backend& cuda) {
  Backend& cpu = *Backends().cpu;
  const std::vector<float> x = RandomNormal(rng, d.m * d.k, 1.0f);
  const std::vector<float> w = RandomNormal(rng, d.n * d.k, 0.05f);
  std::vector<float> outputs[2];
  int i = 0;
  for (Backend* backend : {&cpu, &cuda}) {
    Tensor tx = Upload(*backend, x, DType::kF32, {d.m, d.k});
    Tensor tw = Upload(*backend, w, w_dtype, {d.n, d.k});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {d.m, d.n});
    const absl::Status status = backend->MatMul(tx, tw, ty);
    EXPECT_TRUE(status.ok()) << backend->name() << ": " << status;
    outputs[i++] = Download(*backend, ty);
  }
  return NormalizedError(outputs[1], outputs[0]);
}

TEST(CudaMatMul, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1101);
  std::vector<Dims> cases = {
      // GEMV path (m <= 4): vectorised and scalar (k not a multiple of the 16-byte vector).
      {1, 1, 1}, {1, 7, 13}, {1, 4096, 4096}, {1, 7168, 2048}, {1, 1000, 1001}, {2, 129, 257},
      {3, 1000, 1002}, {4, 64, 100}, {4, 2112, 7168},
      // Tiled paths: small (64) and large (128) tiles, ragged edges in m, n and k.
      {5, 70, 33}, {7, 300, 200}, {64, 64, 64}, {100, 200, 300}, {129, 257, 511},
      {256, 512, 1024}, {1000, 1000, 1000}, {2048, 1536, 1024}};
  for (int i = 0; i < 4; ++i) {
    cases.push_back({RandomInt(rng, 1, 300), RandomInt(rng, 1, 1000), RandomInt(rng, 1, 1000)});
  }
  // The GEMV instantiation of every m <= 8: rows not a multiple of a block's 32, k odd (scalar
  // path) and k a multiple of the vectors spanning several staged x chunks (1024 columns at
  // m = 8, 8192 at m = 1).
  for (std::int64_t m = 1; m <= 8; ++m) {
    cases.push_back({m, 77, 1001});
    cases.push_back({m, 33, 2051});
    cases.push_back({m, 4099, 2056});
  }
  cases.push_back({1, 100, 9000});
  cases.push_back({2, 65, 8200});
  // Few rows, long rows: k split over a cluster of blocks (GemvSplits), GLM-5's latent and
  // indexer-key projections, its router, and rows ending mid-block.
  for (std::int64_t m : {1, 3, 4, 8}) {
    cases.push_back({m, 576, 6144});
    cases.push_back({m, 8, 6144});
    cases.push_back({m, 256, 6144});
    cases.push_back({m, 130, 6150});
  }
  cases.push_back({1, 6144, 16384});
  cases.push_back({2, 2048, 6144});
  // BF16 on the tensor cores (k a multiple of 8): k shorter than a 128-column warp step, than a
  // 512-column round, and a round plus one vector; rows ending mid-tile.
  for (std::int64_t m : {1, 4, 5, 8}) {
    cases.push_back({m, 40, 8});
    cases.push_back({m, 23, 136});
    cases.push_back({m, 300, 520});
  }
  for (DType w_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    // BF16 on each decode GEMV kernel (automatic, tensor cores, fp32 FMAs); the others have one.
    const std::vector<Backend*> cudas =
        w_dtype == DType::kBF16 ? DecodeGemvBackends() : std::vector<Backend*>{Backends().cuda.get()};
    for (std::size_t b = 0; b < cudas.size(); ++b) {
      ErrorSummary summary(absl::StrCat("MatMul w=", DTypeName(w_dtype), cudas.size() > 1 ? kGemvNames[b] : ""),
                           kTolerance);
      for (const Dims& d : cases) {
        SCOPED_TRACE(absl::StrCat("w ", DTypeName(w_dtype), kGemvNames[b], " m=", d.m, " n=", d.n, " k=", d.k));
        summary.Add(CompareMatMul(rng, d, w_dtype, *cudas[b]));
      }
    }
  }
}

// The tensor-core GEMV splits x into bf16 hi + lo: inputs spread over six decades (hidden
// states with outlier channels) keep fp32 accuracy, for every m.
TEST(CudaMatMul, Bf16GemvKeepsFp32AccuracyOverWideInputs) {
  if (Backends().cuda == nullptr) return;
  Backend& cpu = *Backends().cpu;
  Backend& cuda = *DecodeGemvBackends().at(1);  // the tensor cores at every shape
  std::mt19937_64 rng = MakeRng(1107);
  ErrorSummary summary("MatMul BF16 on the tensor cores, x over 1e-3 .. 1e3", kTolerance);
  for (std::int64_t m = 1; m <= 8; ++m) {
    const Dims d{m, 1000, 4096};
    std::vector<float> x = RandomNormal(rng, d.m * d.k, 1.0f);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] *= std::pow(10.0f, static_cast<float>(RandomInt(rng, -3, 3)));
    const std::vector<float> w = RandomNormal(rng, d.n * d.k, 0.05f);
    std::vector<float> outputs[2];
    int i = 0;
    for (Backend* backend : {&cpu, &cuda}) {
      Tensor ty = AllocateOrFail(*backend, DType::kF32, {d.m, d.n});
      NQ_ASSERT_OK(backend->MatMul(Upload(*backend, x, DType::kF32, {d.m, d.k}),
                                   Upload(*backend, w, DType::kBF16, {d.n, d.k}), ty));
      outputs[i++] = Download(*backend, ty);
    }
    SCOPED_TRACE(absl::StrCat("m=", m));
    summary.Add(NormalizedError(outputs[1], outputs[0]));
  }
}

// A token's outputs must not depend on how many tokens share the pass (MTP verification equals
// plain decoding) nor on the run: the split-k sums are added in one fixed order.
void ExpectRowsBitIdenticalWhateverTheTokenCount(Backend& cuda, std::mt19937_64& rng, const Dims& d) {
  const std::vector<float> x = RandomNormal(rng, d.m * d.k, 1.0f);
  const std::vector<float> w = RandomNormal(rng, d.n * d.k, 0.05f);
  Tensor tw = Upload(cuda, w, DType::kBF16, {d.n, d.k});
  Tensor tx = Upload(cuda, x, DType::kF32, {d.m, d.k});
  Tensor all = AllocateOrFail(cuda, DType::kF32, {d.m, d.n});
  NQ_ASSERT_OK(cuda.MatMul(tx, tw, all));
  const std::vector<float> together = Download(cuda, all);
  NQ_ASSERT_OK(cuda.MatMul(tx, tw, all));
  EXPECT_EQ(Download(cuda, all), together) << "a second run differs";
  for (std::int64_t m : {1, 3}) {
    const std::vector<float> first(x.begin(), x.begin() + m * d.k);
    Tensor fewer = AllocateOrFail(cuda, DType::kF32, {m, d.n});
    NQ_ASSERT_OK(cuda.MatMul(Upload(cuda, first, DType::kF32, {m, d.k}), tw, fewer));
    EXPECT_EQ(Download(cuda, fewer), std::vector<float>(together.begin(), together.begin() + m * d.n))
        << m << " tokens differ from the same tokens among " << d.m;
  }
}

TEST(CudaMatMul, GemvRowsAreBitIdenticalWhateverTheTokenCount) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1103);
  const std::vector<Backend*> cudas = DecodeGemvBackends();
  for (std::size_t b = 0; b < cudas.size(); ++b) {
    // Split k (576 and 8 rows), unsplit, the scalar path (k odd), rows ending mid-tile.
    for (const Dims& d : {Dims{8, 576, 6144}, Dims{8, 8, 6144}, Dims{8, 4096, 4096}, Dims{8, 100, 1001},
                          Dims{8, 4300, 2056}}) {
      SCOPED_TRACE(absl::StrCat(kGemvNames[b], " n=", d.n, " k=", d.k));
      ExpectRowsBitIdenticalWhateverTheTokenCount(*cudas[b], rng, d);
    }
  }
}

TEST(CudaMatMul, TensorCoresOnlyForMatricesWhoseBlocksFillTheDevice) {
  using cuda::MmaGemvPays;
  EXPECT_TRUE(MmaGemvPays(4040, 132));  // a vocabulary head
  EXPECT_TRUE(MmaGemvPays(132, 132));   // one 32-row block per SM
  EXPECT_FALSE(MmaGemvPays(131, 132));  // k would be split: latency-bound, the FMA kernel's
  EXPECT_FALSE(MmaGemvPays(18, 132));   // a latent down-projection
}

TEST(CudaMatMul, SplitsKOnlyWhenTheRowsLeaveTheDeviceIdle) {
  using cuda::GemvSplits;
  // 132 SMs.
  EXPECT_EQ(GemvSplits(4000, 48, 132), 1);  // a vocabulary head
  EXPECT_EQ(GemvSplits(192, 64, 132), 1);   // 6144 rows: a block for every SM already
  EXPECT_EQ(GemvSplits(128, 8, 132), 2);    // 4096 rows: just short of one per SM
  EXPECT_EQ(GemvSplits(64, 24, 132), 3);    // 2048 rows
  EXPECT_EQ(GemvSplits(18, 24, 132), 8);    // 576 latent rows
  EXPECT_EQ(GemvSplits(8, 48, 132), 8);     // GLM-5's router (256 rows): every split it can have
  EXPECT_EQ(GemvSplits(1, 48, 132), 8);
  EXPECT_EQ(GemvSplits(1, 3, 132), 3);      // never more splits than column steps
  EXPECT_EQ(GemvSplits(1, 0, 132), 1);
  for (int rows = 1; rows < 2000; rows += 37) {
    for (int sms : {1, 16, 132}) {
      const int s = GemvSplits(rows, 24, sms);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, 8);
    }
  }
}

TEST(CudaMatMul, FoldsLeadingDimensionsAndHandlesEmptyK) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(1102);
  const std::vector<float> x = RandomNormal(rng, 2 * 3 * 40, 1.0f);
  const std::vector<float> w = RandomNormal(rng, 9 * 40, 1.0f);
  std::vector<float> outputs[2];
  int i = 0;
  for (Backend* backend : {Backends().cpu.get(), &cuda}) {
    Tensor tx = Upload(*backend, x, DType::kF32, {2, 3, 40});
    Tensor tw = Upload(*backend, w, DType::kBF16, {9, 40});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {2, 3, 9});
    NQ_ASSERT_OK(backend->MatMul(tx, tw, ty));
    outputs[i++] = Download(*backend, ty);
  }
  EXPECT_LT(NormalizedError(outputs[1], outputs[0]), kTolerance);

  Tensor empty_x = AllocateOrFail(cuda, DType::kF32, {6, 0});
  Tensor empty_w = AllocateOrFail(cuda, DType::kF32, {70, 0});
  Tensor y = Upload(cuda, std::vector<float>(6 * 70, 3.0f), DType::kF32, {6, 70});
  NQ_ASSERT_OK(cuda.MatMul(empty_x, empty_w, y));
  EXPECT_THAT(Download(cuda, y), ::testing::Each(0.0f));
}

TEST(CudaMatMul, RejectsCpuTensors) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Tensor x = AllocateOrFail(cuda, DType::kF32, {2, 8});
  Tensor w = AllocateOrFail(*Backends().cpu, DType::kF32, {4, 8});
  Tensor y = AllocateOrFail(cuda, DType::kF32, {2, 4});
  EXPECT_THAT(cuda.MatMul(x, w, y),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MatMul: w F32[4, 8] belongs to another backend")));
}

}  // namespace
}  // namespace nq::kernels
