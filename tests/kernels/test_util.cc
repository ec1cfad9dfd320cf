#include "tests/kernels/test_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "kernels/tensor_io.h"

namespace nq::kernels::testing {

namespace {

std::unique_ptr<Backend> CpuBackendOrFail(const BackendOptions& options) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", options);
  if (!backend.ok()) {
    ADD_FAILURE() << "CreateBackend(cpu): " << backend.status();
    return nullptr;
  }
  return *std::move(backend);
}

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int threads) {
  return CpuBackendOrFail(BackendOptions{.cpu_threads = threads});
}

std::unique_ptr<Backend> MakeCpuReferenceBackend(int threads) {
  return CpuBackendOrFail(BackendOptions{.cpu_threads = threads, .cpu_float64_attention = true});
}

std::uint64_t TestSeed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s = 0;
    if (const char* env = std::getenv("NQ_TEST_SEED"); env != nullptr && *env != '\0') {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device device;
      s = (std::uint64_t{device()} << 32) ^ device() ^
          static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    std::printf("[   SEED   ] NQ_TEST_SEED=%llu (set it to replay this run)\n",
                static_cast<unsigned long long>(s));
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

std::mt19937_64 MakeRng(std::uint64_t salt) {
  std::seed_seq seq{TestSeed(), salt, std::uint64_t{0x9e3779b97f4a7c15ull}};
  return std::mt19937_64(seq);
}

std::vector<float> RandomUniform(std::mt19937_64& rng, std::size_t count, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(count);
  for (float& v : out) v = dist(rng);
  return out;
}

std::vector<float> RandomNormal(std::mt19937_64& rng, std::size_t count, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(count);
  for (float& v : out) v = dist(rng);
  return out;
}

std::int64_t RandomInt(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

std::vector<std::uint8_t> RandomE4M3(std::mt19937_64& rng, std::size_t count, bool allow_nan) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::uint8_t> out(count);
  for (std::uint8_t& b : out) {
    do {
      b = static_cast<std::uint8_t>(byte(rng));
    } while (!allow_nan && (b & 0x7f) == 0x7f);
  }
  return out;
}

std::vector<float> RoundTo(DType dtype, std::span<const float> values) {
  std::vector<float> out(values.begin(), values.end());
  for (float& v : out) {
    switch (dtype) {
      case DType::kF32: break;
      case DType::kBF16: v = ToFloat(ToBf16(v)); break;
      case DType::kF16: v = ToFloat(ToF16(v)); break;
      case DType::kI32: v = std::nearbyint(v); break;
      case DType::kU8:
      case DType::kF8E4M3:
        ADD_FAILURE() << "RoundTo: " << DTypeName(dtype) << " is not a rounding target";
        break;
    }
  }
  return out;
}

std::vector<double> RefMatMul(std::span<const float> x, std::span<const float> w, std::int64_t m,
                              std::int64_t n, std::int64_t k) {
  std::vector<double> y(m * n);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (std::int64_t p = 0; p < k; ++p) sum += double{x[i * k + p]} * w[j * k + p];
      y[i * n + j] = sum;
    }
  }
  return y;
}

std::vector<double> RefRmsNorm(std::span<const float> x, std::span<const float> weight,
                               std::int64_t rows, std::int64_t cols, double eps) {
  std::vector<double> y(rows * cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum_sq = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) sum_sq += double{x[r * cols + c]} * x[r * cols + c];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / cols + eps);
    for (std::int64_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * inv_rms * weight[c];
  }
  return y;
}

std::vector<double> RefSiluAndMul(std::span<const float> x, std::int64_t rows, std::int64_t d) {
  std::vector<double> y(rows * d);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < d; ++j) {
      const double gate = x[r * 2 * d + j];
      const double up = x[r * 2 * d + d + j];
      y[r * d + j] = gate / (1.0 + std::exp(-gate)) * up;
    }
  }
  return y;
}

std::vector<double> RefSoftmax(std::span<const float> x, std::int64_t rows, std::int64_t cols,
                               double scale) {
  std::vector<double> y(rows * cols, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double max = -std::numeric_limits<double>::infinity();
    for (std::int64_t c = 0; c < cols; ++c) max = std::max(max, x[r * cols + c] * scale);
    if (std::isinf(max) && max < 0) continue;  // fully masked: zeros
    double sum = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) sum += std::exp(x[r * cols + c] * scale - max);
    for (std::int64_t c = 0; c < cols; ++c) {
      y[r * cols + c] = std::exp(x[r * cols + c] * scale - max) / sum;
    }
  }
  return y;
}

namespace {

template <typename Want>
double NormalizedErrorImpl(std::span<const float> got, std::span<const Want> want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double max_diff = 0.0;
  double max_ref = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::abs(double{got[i]} - double{want[i]});
    if (std::isnan(diff)) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, diff);
    max_ref = std::max(max_ref, std::abs(double{want[i]}));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

}  // namespace

double NormalizedError(std::span<const float> got, std::span<const double> want) {
  return NormalizedErrorImpl(got, want);
}

double NormalizedError(std::span<const float> got, std::span<const float> want) {
  return NormalizedErrorImpl(got, want);
}

Tensor Upload(Backend& backend, std::span<const float> values, DType dtype, Shape shape) {
  absl::StatusOr<Tensor> tensor = UploadFloats(backend, values, dtype, std::move(shape));
  if (!tensor.ok()) {
    ADD_FAILURE() << "UploadFloats: " << tensor.status();
    return Tensor();
  }
  return *std::move(tensor);
}

Tensor UploadBytes(Backend& backend, std::span<const std::uint8_t> bytes, DType dtype,
                   Shape shape) {
  absl::StatusOr<Tensor> tensor = backend.Allocate(dtype, std::move(shape));
  if (!tensor.ok()) {
    ADD_FAILURE() << "Allocate: " << tensor.status();
    return Tensor();
  }
  if (DTypeSize(dtype) != 1) {
    ADD_FAILURE() << "UploadBytes: " << DTypeName(dtype) << " is not a 1-byte dtype";
    return Tensor();
  }
  const absl::Status status = backend.CopyFromHost(std::as_bytes(bytes), *tensor);
  if (!status.ok()) {
    ADD_FAILURE() << "CopyFromHost: " << status;
    return Tensor();
  }
  return *std::move(tensor);
}

std::vector<float> Download(Backend& backend, const Tensor& tensor) {
  absl::StatusOr<std::vector<float>> values = DownloadFloats(backend, tensor);
  if (!values.ok()) {
    ADD_FAILURE() << "DownloadFloats: " << values.status();
    return {};
  }
  return *std::move(values);
}

Tensor AllocateOrFail(Backend& backend, DType dtype, Shape shape) {
  absl::StatusOr<Tensor> tensor = backend.Allocate(dtype, std::move(shape));
  if (!tensor.ok()) {
    ADD_FAILURE() << "Allocate: " << tensor.status();
    return Tensor();
  }
  return *std::move(tensor);
}

Tensor UploadI32(Backend& backend, std::span<const std::int32_t> values, Shape shape) {
  absl::StatusOr<Tensor> tensor = UploadInt32s(backend, values, std::move(shape));
  if (!tensor.ok()) {
    ADD_FAILURE() << "UploadInt32s: " << tensor.status();
    return Tensor();
  }
  return *std::move(tensor);
}

std::vector<std::int32_t> DownloadI32(Backend& backend, const Tensor& tensor) {
  absl::StatusOr<std::vector<std::int32_t>> values = DownloadInt32s(backend, tensor);
  if (!values.ok()) {
    ADD_FAILURE() << "DownloadInt32s: " << values.status();
    return {};
  }
  return *std::move(values);
}

}  // namespace nq::kernels::testing
