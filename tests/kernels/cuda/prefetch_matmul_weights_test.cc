// CUDA Backend::PrefetchMatMulWeights (kernels/cuda/l2_prefetch.cu): bulk L2 prefetches of the
// starts of a weight's rows (or of its split-k ranges). A hint cannot change a result, so what is
// checked is that it never faults (rows at any alignment, any byte count, every weight dtype, the
// side stream, a captured graph; the device scripts run these under compute-sanitizer memcheck)
// and that a MatMul after it equals one without it, bit for bit, and the CPU's within tolerance.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
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
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;

struct Case {
  std::int64_t n, k;
  DType dtype;
};

// Ragged rows (row starts off 16-byte bounds), a split-k few-row matrix, o_proj's GLM-5 shape.
const Case kCases[] = {{33, 70, DType::kBF16}, {17, 33, DType::kF32},    {40, 99, DType::kF16},
                       {8, 4096, DType::kBF16}, {6144, 16384, DType::kBF16}};
const std::int64_t kBytes[] = {0, 15, 16, 1000, 1 << 20, std::int64_t{1} << 40};

TEST(CudaPrefetchMatMulWeights, AMatMulAfterItIsUnchanged) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Backend& cpu = *Backends().cpu;
  ErrorSummary summary("MatMul after PrefetchMatMulWeights", 1e-4);
  std::mt19937_64 rng = MakeRng(4402);
  for (const Case& c : kCases) {
    const std::vector<float> x = RandomNormal(rng, 2 * c.k, 1.0f), w = RandomNormal(rng, c.n * c.k, 1.0f);
    Tensor cx = Upload(cuda, x, DType::kF32, {2, c.k}), cw = Upload(cuda, w, c.dtype, {c.n, c.k});
    Tensor plain = AllocateOrFail(cuda, DType::kF32, {2, c.n});
    NQ_ASSERT_OK(cuda.MatMul(cx, cw, plain));
    Tensor hx = Upload(cpu, x, DType::kF32, {2, c.k}), hw = Upload(cpu, w, c.dtype, {c.n, c.k});
    Tensor reference = AllocateOrFail(cpu, DType::kF32, {2, c.n});
    NQ_ASSERT_OK(cpu.MatMul(hx, hw, reference));
    for (std::int64_t bytes : kBytes) {
      for (const bool keep : {false, true}) {
        SCOPED_TRACE(absl::StrCat(c.n, " x ", c.k, " ", DTypeName(c.dtype), ", ", bytes, " bytes", keep ? ", kept" : ""));
        Tensor y = AllocateOrFail(cuda, DType::kF32, {2, c.n});
        NQ_ASSERT_OK(cuda.BeginSideWork());
        NQ_ASSERT_OK(cuda.PrefetchMatMulWeights({&cw}, bytes, keep));
        NQ_ASSERT_OK(cuda.EndSideWork());
        NQ_ASSERT_OK(cuda.MatMul(cx, cw, y));
        NQ_ASSERT_OK(cuda.JoinSideWork());
        NQ_ASSERT_OK(cuda.Synchronize());
        EXPECT_EQ(Download(cuda, y), Download(cuda, plain));
        summary.Add(NormalizedError(Download(cuda, y), Download(cpu, reference)));
      }
    }
  }
}

TEST(CudaPrefetchMatMulWeights, Fp8WeightsAndACapturedGraph) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(4403);
  Tensor fp8 = AllocateOrFail(cuda, DType::kF8E4M3, {129, 200});  // 200-byte rows: every alignment mod 16
  for (std::int64_t bytes : kBytes) {
    NQ_ASSERT_OK(cuda.PrefetchMatMulWeights({&fp8}, bytes));
    NQ_ASSERT_OK(cuda.PrefetchMatMulWeights({&fp8}, bytes, /*keep=*/true));
  }
  NQ_ASSERT_OK(cuda.Synchronize());

  constexpr std::int64_t kN = 300, kK = 1000;
  const std::vector<float> x = RandomNormal(rng, kK, 1.0f), w = RandomNormal(rng, kN * kK, 1.0f);
  Tensor cx = Upload(cuda, x, DType::kF32, {1, kK}), cw = Upload(cuda, w, DType::kBF16, {kN, kK});
  Tensor plain = AllocateOrFail(cuda, DType::kF32, {1, kN}), y = AllocateOrFail(cuda, DType::kF32, {1, kN});
  NQ_ASSERT_OK(cuda.MatMul(cx, cw, plain));
  NQ_ASSERT_OK(cuda.Synchronize());
  NQ_ASSERT_OK(cuda.BeginCapture());
  absl::Status issued = cuda.BeginSideWork();
  if (issued.ok()) issued = cuda.PrefetchMatMulWeights({&cw}, 64 << 10, /*keep=*/true);
  if (issued.ok()) issued = cuda.EndSideWork();
  if (issued.ok()) issued = cuda.MatMul(cx, cw, y);
  if (issued.ok()) issued = cuda.JoinSideWork();
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = cuda.EndCapture();
  NQ_ASSERT_OK(issued);
  NQ_ASSERT_OK(graph.status());
  for (int replay = 0; replay < 3; ++replay) {
    NQ_ASSERT_OK((*graph)->Run());
    EXPECT_EQ(Download(cuda, y), Download(cuda, plain)) << "replay " << replay;
  }
}

}  // namespace
}  // namespace nq::kernels
