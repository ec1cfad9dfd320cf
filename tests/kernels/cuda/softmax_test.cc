// CUDA Softmax vs the CPU backend on fresh random inputs: scales, vocabulary-sized rows, masks.
#include <cstdint>
#include <limits>
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
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;

// fp32 exp and an fp32 tree-summed denominator against the CPU's double sum.
constexpr double kTolerance = 1e-5;

std::vector<float> RunBoth(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                           float scale, std::vector<float>* cpu_out) {
  std::vector<float> outputs[2];
  int i = 0;
  for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
    Tensor tx = Upload(*backend, x, DType::kF32, {rows, cols});
    Tensor ty = AllocateOrFail(*backend, DType::kF32, {rows, cols});
    const absl::Status status = backend->Softmax(tx, scale, ty);
    EXPECT_TRUE(status.ok()) << backend->name() << ": " << status;
    outputs[i++] = Download(*backend, ty);
  }
  *cpu_out = std::move(outputs[0]);
  return std::move(outputs[1]);
}

TEST(CudaSoftmax, MatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1401);
  // 129280: DeepSeek-V3's vocabulary (sampling over logits).
  std::vector<std::pair<std::int64_t, std::int64_t>> cases = {
      {1, 1}, {4, 7}, {8, 129}, {32, 4096}, {3, 100003}, {16, 129280}, {512, 2048}};
  for (int i = 0; i < 3; ++i) cases.emplace_back(RandomInt(rng, 1, 300), RandomInt(rng, 1, 9000));
  // 0.0721 ~ 1/sqrt(192), MLA's q/k head dim.
  for (float scale : {1.0f, 0.0721f}) {
    ErrorSummary summary(absl::StrCat("Softmax scale=", scale), kTolerance);
    for (const auto& [rows, cols] : cases) {
      SCOPED_TRACE(absl::StrCat("scale=", scale, " rows=", rows, " cols=", cols));
      const std::vector<float> x = RandomNormal(rng, rows * cols, 8.0f);
      std::vector<float> cpu;
      const std::vector<float> cuda = RunBoth(x, rows, cols, scale, &cpu);
      summary.Add(NormalizedError(cuda, cpu));
    }
  }
}

TEST(CudaSoftmax, MaskedAndFullyMaskedRowsMatchCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(1402);
  constexpr std::int64_t kRows = 6;
  constexpr std::int64_t kCols = 1030;
  std::vector<float> x = RandomNormal(rng, kRows * kCols, 4.0f);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Row 0 causal-style (second half masked), row 1 every other entry, row 2 fully masked.
  for (std::int64_t c = kCols / 2; c < kCols; ++c) x[c] = neg_inf;
  for (std::int64_t c = 0; c < kCols; c += 2) x[kCols + c] = neg_inf;
  for (std::int64_t c = 0; c < kCols; ++c) x[2 * kCols + c] = neg_inf;
  std::vector<float> cpu;
  const std::vector<float> cuda = RunBoth(x, kRows, kCols, 0.5f, &cpu);
  EXPECT_LT(NormalizedError(cuda, cpu), kTolerance);
  for (std::int64_t c = 0; c < kCols; ++c) ASSERT_EQ(cuda[2 * kCols + c], 0.0f) << c;
}

}  // namespace
}  // namespace nq::kernels
