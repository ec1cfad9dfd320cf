#include "services/quant/hadamard.h"

#include <bit>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace nq::quant {
namespace {

// Generic in-place normalised FWHT over any arithmetic type (float for weights, double for
// Hessians).
template <typename T>
void Fwht(T* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1) {
    for (int64_t i = 0; i < n; i += len << 1) {
      for (int64_t j = i; j < i + len; ++j) {
        const T a = x[j];
        const T b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

template <typename T>
void Rotate(T* x, const float* signs, int64_t n, int64_t block) {
  for (int64_t i = 0; i < n; ++i) x[i] *= static_cast<T>(signs[i]);
  for (int64_t b = 0; b < n; b += block) Fwht(x + b, block);
}

template <typename T>
void Unrotate(T* x, const float* signs, int64_t n, int64_t block) {
  for (int64_t b = 0; b < n; b += block) Fwht(x + b, block);
  for (int64_t i = 0; i < n; ++i) x[i] *= static_cast<T>(signs[i]);
}

// Applies `fn` to every column of row-major w (rows x cols) through a gathered buffer.
template <typename T, typename Fn>
void ForEachColumn(T* w, int64_t rows, int64_t cols, Fn fn) {
  std::vector<T> col(static_cast<size_t>(rows));
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i) col[i] = w[i * cols + j];
    fn(col.data());
    for (int64_t i = 0; i < rows; ++i) w[i * cols + j] = col[i];
  }
}

absl::Status CheckMatrix(size_t size, int64_t rows, int64_t cols, const RotationParams& p) {
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix must be non-empty, got ", rows, " x ", cols));
  }
  if (static_cast<int64_t>(size) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("matrix buffer holds ", size,
                                                   " values, expected ", rows, " x ", cols));
  }
  if (auto s = ValidateHadamardBlock(rows, p.row_block, "rows"); !s.ok()) return s;
  return ValidateHadamardBlock(cols, p.col_block, "cols");
}

}  // namespace

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::vector<float> RandomSigns(uint64_t seed, int64_t n) {
  std::vector<float> signs(static_cast<size_t>(n));
  uint64_t state = seed;
  uint64_t bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 64 == 0) bits = SplitMix64(state);
    signs[i] = (bits & 1) ? -1.0f : 1.0f;
    bits >>= 1;
  }
  return signs;
}

void FwhtInPlace(std::span<float> x) { Fwht(x.data(), static_cast<int64_t>(x.size())); }

absl::Status ValidateHadamardBlock(int64_t n, int64_t block, const char* what) {
  if (block < kMinHadamardBlock || block > kMaxHadamardBlock ||
      !std::has_single_bit(static_cast<uint64_t>(block))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Hadamard block for ", what, " must be a power of two in [", kMinHadamardBlock, ", ",
        kMaxHadamardBlock, "], got ", block));
  }
  if (n % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " = ", n,
                                                   " is not a multiple of the Hadamard block ",
                                                   block));
  }
  return absl::OkStatus();
}

void RotateVector(std::span<float> x, std::span<const float> signs, int64_t block) {
  Rotate(x.data(), signs.data(), static_cast<int64_t>(x.size()), block);
}

void UnrotateVector(std::span<float> x, std::span<const float> signs, int64_t block) {
  Unrotate(x.data(), signs.data(), static_cast<int64_t>(x.size()), block);
}

absl::Status RotateMatrix(std::span<float> w, int64_t rows, int64_t cols,
                          const RotationParams& params) {
  if (auto s = CheckMatrix(w.size(), rows, cols, params); !s.ok()) return s;
  const std::vector<float> col_signs = RandomSigns(params.col_sign_seed, cols);
  const std::vector<float> row_signs = RandomSigns(params.row_sign_seed, rows);
  for (int64_t i = 0; i < rows; ++i) {
    Rotate(w.data() + i * cols, col_signs.data(), cols, params.col_block);
  }
  ForEachColumn(w.data(), rows, cols,
                [&](float* c) { Rotate(c, row_signs.data(), rows, params.row_block); });
  return absl::OkStatus();
}

absl::Status UnrotateMatrix(std::span<float> w, int64_t rows, int64_t cols,
                            const RotationParams& params) {
  if (auto s = CheckMatrix(w.size(), rows, cols, params); !s.ok()) return s;
  const std::vector<float> col_signs = RandomSigns(params.col_sign_seed, cols);
  const std::vector<float> row_signs = RandomSigns(params.row_sign_seed, rows);
  ForEachColumn(w.data(), rows, cols,
                [&](float* c) { Unrotate(c, row_signs.data(), rows, params.row_block); });
  for (int64_t i = 0; i < rows; ++i) {
    Unrotate(w.data() + i * cols, col_signs.data(), cols, params.col_block);
  }
  return absl::OkStatus();
}

absl::Status RotateSymmetric(std::span<double> h, int64_t dim, int64_t block, uint64_t seed) {
  if (dim <= 0 || static_cast<int64_t>(h.size()) != dim * dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("symmetric matrix buffer holds ", h.size(), " values, expected ", dim,
                     " x ", dim));
  }
  if (auto s = ValidateHadamardBlock(dim, block, "Hessian dim"); !s.ok()) return s;
  const std::vector<float> signs = RandomSigns(seed, dim);
  // R H R^T: rotate every row (H R^T), then every column (R (H R^T)).
  for (int64_t i = 0; i < dim; ++i) Rotate(h.data() + i * dim, signs.data(), dim, block);
  ForEachColumn(h.data(), dim, dim, [&](double* c) { Rotate(c, signs.data(), dim, block); });
  return absl::OkStatus();
}

}  // namespace nq::quant
