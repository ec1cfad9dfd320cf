// CUDA SiluAndMul vs the CPU backend on fresh random inputs.
#include <cstdint>
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
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::Upload;

// fp32 elementwise; CUDA's expf is within 2 ulp of the CPU's.
constexpr double kTolerance = 1e-5;

TEST(CudaSiluAndMul, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1301);
  // d % 4 != 0 exercises the scalar kernel, the rest the float4 one.
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {
      {1, 1}, {3, 5}, {17, 2048}, {5, 1001}, {64, 18432}, {1000, 4096}, {1, 2047}};
  for (int i = 0; i < 3; ++i) cases.emplace_back(RandomInt(rng, 1, 500), RandomInt(rng, 1, 5000));
  ErrorSummary summary("SiluAndMul", kTolerance);
  for (const auto& [rows, d] : cases) {
    SCOPED_TRACE(absl::StrCat("rows=", rows, " d=", d));
    const std::vector<float> x = RandomUniform(rng, rows * 2 * d, -12.0f, 12.0f);
    std::vector<float> outputs[2];
    int i = 0;
    for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
      Tensor tx = Upload(*backend, x, DType::kF32, {rows, 2 * d});
      Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, d});
      NQ_ASSERT_OK(backend->SiluAndMul(tx, ty));
      outputs[i++] = Download(*backend, ty);
    }
    summary.Add(NormalizedError(outputs[1], outputs[0]));
  }
}

}  // namespace
}  // namespace nq::kernels
