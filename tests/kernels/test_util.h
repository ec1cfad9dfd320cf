// Shared helpers for the kernel tests: seeded random inputs, naive double-precision references,
// the normalised error of llama.cpp's test-backend-ops, and a StatusIs matcher.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "kernels/backend.h"

// Fails the test (ASSERT) / records a failure (EXPECT) with the status when `expr` is not OK.
#define NQ_ASSERT_OK(expr)                  \
  do {                                      \
    const ::absl::Status nq_status_ = (expr); \
    ASSERT_TRUE(nq_status_.ok()) << nq_status_; \
  } while (false)
#define NQ_EXPECT_OK(expr)                  \
  do {                                      \
    const ::absl::Status nq_status_ = (expr); \
    EXPECT_TRUE(nq_status_.ok()) << nq_status_; \
  } while (false)

namespace nq::kernels::testing {

// A CPU backend for tests, `threads` workers (CI has two cores).
std::unique_ptr<Backend> MakeCpuBackend(int threads = 2);
// The same with the float64 MlaAttention reference (BackendOptions::cpu_float64_attention).
std::unique_ptr<Backend> MakeCpuReferenceBackend(int threads = 2);

// The run's seed: $NQ_TEST_SEED if set, else from std::random_device and the clock. Printed
// once ("NQ_TEST_SEED=...") so a failing run can be replayed.
std::uint64_t TestSeed();

// A generator for one test: TestSeed() mixed with `salt` (use a per-test constant), so tests
// stay independent of each other's draw counts.
std::mt19937_64 MakeRng(std::uint64_t salt);

// `count` values uniform in [lo, hi).
std::vector<float> RandomUniform(std::mt19937_64& rng, std::size_t count, float lo, float hi);
// `count` values from N(0, stddev^2).
std::vector<float> RandomNormal(std::mt19937_64& rng, std::size_t count, float stddev);
// A uniform integer in [lo, hi].
std::int64_t RandomInt(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi);
// `count` uniformly random E4M3 bit patterns (every sign, exponent and subnormal), without the two
// NaNs (0x7f, 0xff) unless `allow_nan`.
std::vector<std::uint8_t> RandomE4M3(std::mt19937_64& rng, std::size_t count, bool allow_nan);

// The values `dtype` can hold nearest to `values` (identity for F32, nearest integer for I32):
// what a tensor of that dtype stores after an upload, so references see exactly the weights the
// kernels see.
std::vector<float> RoundTo(DType dtype, std::span<const float> values);

// Naive references in double precision.
std::vector<double> RefMatMul(std::span<const float> x, std::span<const float> w, std::int64_t m,
                              std::int64_t n, std::int64_t k);
std::vector<double> RefRmsNorm(std::span<const float> x, std::span<const float> weight,
                               std::int64_t rows, std::int64_t cols, double eps);
std::vector<double> RefSiluAndMul(std::span<const float> x, std::int64_t rows, std::int64_t d);
std::vector<double> RefSoftmax(std::span<const float> x, std::int64_t rows, std::int64_t cols,
                               double scale);

// max|got - want| / max|want| (max|got - want| when want is all zeros). A NaN anywhere gives
// +inf, so it fails every tolerance.
double NormalizedError(std::span<const float> got, std::span<const double> want);
double NormalizedError(std::span<const float> got, std::span<const float> want);

// UploadFloats / DownloadFloats that fail the test (ADD_FAILURE) and return empty on error.
Tensor Upload(Backend& backend, std::span<const float> values, DType dtype, Shape shape);
std::vector<float> Download(Backend& backend, const Tensor& tensor);
Tensor AllocateOrFail(Backend& backend, DType dtype, Shape shape);
// UploadInt32s / DownloadInt32s likewise (I32 tensors: token ids, selected keys).
Tensor UploadI32(Backend& backend, std::span<const std::int32_t> values, Shape shape);
std::vector<std::int32_t> DownloadI32(Backend& backend, const Tensor& tensor);
// A new tensor of 1-byte `dtype` (U8, F8_E4M3) holding `bytes` as they are; fails the test and
// returns an empty tensor on error.
Tensor UploadBytes(Backend& backend, std::span<const std::uint8_t> bytes, DType dtype,
                   Shape shape);

MATCHER_P2(StatusIs, code, message_matcher,
           "status code " + ::testing::PrintToString(code) + " with a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& status = arg;
  if (status.code() != code) {
    *result_listener << "got " << status.ToString();
    return false;
  }
  return ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

}  // namespace nq::kernels::testing
