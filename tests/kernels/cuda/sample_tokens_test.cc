// CUDA SampleTokens vs the CPU backend (kernels::SampleRowHost): the same id on every row, bit
// for bit (the weights are integers, so no summation order can move a pick), over vocabularies
// like DeepSeek-V3's and GLM-5's and odd ones (no 16-byte loads), rows with runs of equal logits
// and non-finite ones, greedy, temperature, top-k and top-p, and several rows at once. Then a
// timing printout of one 129280-id row per setting.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sample_tokens.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::DownloadI32;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::UploadBytes;
using ::nq::kernels::testing::Upload;

Tensor UploadParams(Backend& backend, const std::vector<SampleParams>& params) {
  std::vector<std::uint8_t> bytes(params.size() * sizeof(SampleParams));
  std::memcpy(bytes.data(), params.data(), bytes.size());
  return UploadBytes(backend, bytes, DType::kU8,
                     {static_cast<std::int64_t>(params.size()), static_cast<std::int64_t>(sizeof(SampleParams))});
}

TEST(CudaSampleTokens, PicksTheCpuBackendsIdOnEveryRow) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(9117);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const std::vector<SampleParams> settings = {
      {.temperature = 0},
      {.temperature = 1.0f},
      {.temperature = 0.6f, .top_p = 0.95f},
      {.temperature = 1.3f, .top_k = 50},
      {.temperature = 0.8f, .top_p = 0.3f, .top_k = 1000},
      {.temperature = 0.05f},
      {.temperature = 2.0f, .top_p = 0.999f, .top_k = 3},
      {.temperature = 1.0f, .top_k = 1},
  };
  int rows_checked = 0;
  // 262144 ids: too many for a block's chunk of weights in shared memory (the uncached kernel).
  for (std::int64_t vocab : {129280, 154880, 262144, 1001, 7}) {
    for (int kind = 0; kind < 4; ++kind) {
      const std::int64_t R = kind == 3 ? 4 : 1;
      std::vector<float> logits = RandomNormal(rng, static_cast<size_t>(R * vocab), 2.5f);
      if (kind == 1) {
        for (float& l : logits) l = std::round(l * 2) / 2;  // runs of equal logits
      }
      if (kind == 2) {  // non-finite entries; a flat row, where every id ties
        for (size_t i = 0; i < logits.size(); i += 13) logits[i] = -std::numeric_limits<float>::infinity();
        for (size_t i = 5; i < logits.size(); i += 29) logits[i] = std::numeric_limits<float>::quiet_NaN();
        if (vocab == 1001) std::fill(logits.begin(), logits.end(), 0.25f);
      }
      for (const SampleParams& base : settings) {
        for (int draw = 0; draw < 4; ++draw) {
          std::vector<SampleParams> params(static_cast<size_t>(R), base);
          for (SampleParams& p : params) p.u01 = draw == 3 ? 0.9999999 : uniform(rng);
          std::vector<std::int32_t> got[2];
          int b = 0;
          for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
            Tensor l = Upload(*backend, logits, DType::kF32, {R, vocab});
            Tensor p = UploadParams(*backend, params);
            Tensor ids = AllocateOrFail(*backend, DType::kI32, {R});
            NQ_ASSERT_OK(backend->SampleTokens(l, p, ids));
            got[b++] = DownloadI32(*backend, ids);
          }
          ASSERT_EQ(got[1], got[0]) << "vocab " << vocab << " kind " << kind << " temperature " << base.temperature
                                    << " top_p " << base.top_p << " top_k " << base.top_k << " u01 " << params[0].u01;
          rows_checked += static_cast<int>(R);
        }
      }
    }
  }
  std::printf("[ compare  ] SampleTokens: %d rows, every id equal\n", rows_checked);
  // A row without a finite logit.
  Backend& cuda = *Backends().cuda;
  Tensor l = Upload(cuda, std::vector<float>(64, std::numeric_limits<float>::quiet_NaN()), DType::kF32, {1, 64});
  Tensor p = UploadParams(cuda, {{.u01 = 0.5, .temperature = 1.0f}});
  Tensor ids = AllocateOrFail(cuda, DType::kI32, {1});
  NQ_ASSERT_OK(cuda.SampleTokens(l, p, ids));
  EXPECT_EQ(DownloadI32(cuda, ids), std::vector<std::int32_t>{kNoFiniteLogit});
}

TEST(CudaSampleTokens, Timing) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(9118);
  const std::vector<std::pair<const char*, SampleParams>> settings = {
      {"greedy", {.temperature = 0}},
      {"temperature 0.7", {.u01 = 0.4, .temperature = 0.7f}},
      {"top_k 50", {.u01 = 0.4, .temperature = 0.7f, .top_k = 50}},
      {"top_p 0.95", {.u01 = 0.4, .temperature = 0.7f, .top_p = 0.95f}},
  };
  // DeepSeek-V3's and GLM-5's vocabularies, a batch of 8 rows, and a row too long for the
  // weights to be kept in shared memory.
  for (const auto& [rows, vocab] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 129280}, {1, 154880}, {8, 154880}, {1, 262144}}) {
    Tensor l = Upload(cuda, RandomNormal(rng, static_cast<size_t>(rows * vocab), 2.5f), DType::kF32, {rows, vocab});
    Tensor ids = AllocateOrFail(cuda, DType::kI32, {rows});
    for (const auto& [name, params] : settings) {
      Tensor p = UploadParams(cuda, std::vector<SampleParams>(static_cast<size_t>(rows), params));
      NQ_ASSERT_OK(cuda.SampleTokens(l, p, ids));
      NQ_ASSERT_OK(cuda.Synchronize());
      constexpr int kRuns = 200;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < kRuns; ++i) NQ_ASSERT_OK(cuda.SampleTokens(l, p, ids));
      NQ_ASSERT_OK(cuda.Synchronize());
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / kRuns;
      std::printf("[ timing   ] SampleTokens %s, %lld x %lld ids: %.1f us per call (launches back to back)\n", name,
                  static_cast<long long>(rows), static_cast<long long>(vocab), us);
    }
  }
}

}  // namespace
}  // namespace nq::kernels
