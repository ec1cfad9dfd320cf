// CPU reference MatMul: y[m, n] = x[m, k] · w[n, k]^T.
//
// MatMulBlockScaled is the same product with each FP8 weight row widened and multiplied by its
// 128 x 128 block scale on the way in (the oracle for the CUDA FP8 kernels).
//
// Both operands are k-contiguous, so every output is a dot product of two contiguous rows.
// For each block of kTile rows of w (widened once to fp32 for 16-bit weights, then hot in L1),
// every row of x runs DotRows against it: one x row against kTile w rows. Every row of x takes
// the same path with the same summation order, so a row's output does not depend on how many
// rows share the call (batch invariance: speculative decoding verifies 1 + N tokens in one
// forward and must reproduce plain decoding's one-token forwards bit for bit). Threads split
// the n dimension, so decode (m == 1) is parallel too.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec4.h"

namespace nq::kernels::cpu {
namespace {

// w rows per DotRows call: each keeps two 4-float accumulators, so 8 vector registers.
constexpr int kTile = 4;
// Below this many multiply-adds a call runs on one thread (spawning threads costs ~tens of us).
constexpr std::int64_t kParallelMinFmas = std::int64_t{1} << 22;

// out[j] = dot(x, w_rows[j]) over k, for one row of x. Each w row keeps two 4-float vectors
// of independent partial sums (vec4.h), added together at the end: the sums are in registers
// and no float sum is reassociated by the compiler.
void DotRows(const float* x, const float* const w_rows[kTile], std::int64_t k, float out[kTile]) {
  static_assert(kTile == 4, "DotRows names its four w rows");
  const float* w0 = w_rows[0];
  const float* w1 = w_rows[1];
  const float* w2 = w_rows[2];
  const float* w3 = w_rows[3];
  Vec4 a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
  std::int64_t p = 0;
  for (; p + 8 <= k; p += 8) {
    const Vec4 xa = Load4(x + p);
    const Vec4 xb = Load4(x + p + 4);
    a0 += xa * Load4(w0 + p);
    b0 += xb * Load4(w0 + p + 4);
    a1 += xa * Load4(w1 + p);
    b1 += xb * Load4(w1 + p + 4);
    a2 += xa * Load4(w2 + p);
    b2 += xb * Load4(w2 + p + 4);
    a3 += xa * Load4(w3 + p);
    b3 += xb * Load4(w3 + p + 4);
  }
  const float partial[kTile] = {Sum4(a0 + b0), Sum4(a1 + b1), Sum4(a2 + b2), Sum4(a3 + b3)};
  for (int j = 0; j < kTile; ++j) {
    float sum = partial[j];
    for (std::int64_t q = p; q < k; ++q) sum += x[q] * w_rows[j][q];
    out[j] = sum;
  }
}

// How MatMulColumns gets a row of w as fp32: F32 rows are used in place; other dtypes are widened
// into `dst` (k floats) and that is used instead.
struct PlainRows {
  template <typename WeightT>
  const float* operator()(const WeightT* w, std::int64_t row, std::int64_t k, float* dst) const {
    if constexpr (std::is_same_v<WeightT, float>) {
      return w + row * k;
    } else {
      const WeightT* src = w + row * k;
      for (std::int64_t p = 0; p < k; ++p) dst[p] = ToFloat(src[p]);
      return dst;
    }
  }
};

// FP8 rows times their block scales: w[row, p] = float(fp8) * scale_inv[row / 128, p / 128].
struct BlockScaledRows {
  const float* scale_inv;  // [ceil(n / 128), ceil(k / 128)]
  std::int64_t scale_cols;

  const float* operator()(const F8E4M3* w, std::int64_t row, std::int64_t k, float* dst) const {
    const F8E4M3* src = w + row * k;
    const float* scales = scale_inv + (row / kWeightScaleBlock) * scale_cols;
    for (std::int64_t p = 0; p < k; ++p) dst[p] = ToFloat(src[p]) * scales[p / kWeightScaleBlock];
    return dst;
  }
};

// Computes columns [n_begin, n_end) of y; n_begin is a multiple of kTile. `rows` yields each row of
// w as fp32 (PlainRows, BlockScaledRows).
template <typename WeightT, typename Rows>
void MatMulColumns(const float* x, const WeightT* w, const Rows& rows, float* y,
                   const MatMulDims& dims, std::int64_t n_begin, std::int64_t n_end) {
  const std::int64_t k = dims.k;
  std::vector<float> widened;  // kTile rows of w as fp32, for weights not stored as F32
  if constexpr (!std::is_same_v<WeightT, float>) widened.resize(kTile * k);
  for (std::int64_t n0 = n_begin; n0 < n_end; n0 += kTile) {
    const int n_valid = static_cast<int>(std::min<std::int64_t>(kTile, n_end - n0));
    const float* w_rows[kTile];
    for (int j = 0; j < kTile; ++j) {
      const std::int64_t row = n0 + std::min(j, n_valid - 1);
      w_rows[j] = rows(w, row, k, widened.empty() ? nullptr : widened.data() + j * k);
    }
    for (std::int64_t i = 0; i < dims.m; ++i) {
      float out[kTile];
      DotRows(x + i * k, w_rows, k, out);
      for (int j = 0; j < n_valid; ++j) y[i * dims.n + n0 + j] = out[j];
    }
  }
}

template <typename WeightT, typename Rows>
void MatMulParallel(const float* x, const WeightT* w, const Rows& rows, float* y,
                    const MatMulDims& dims, int threads) {
  const std::int64_t fmas = dims.m * dims.n * std::max<std::int64_t>(dims.k, 1);
  const int use_threads = fmas < kParallelMinFmas ? 1 : threads;
  ParallelFor(
      dims.n, kTile, use_threads,
      [&](std::int64_t begin, std::int64_t end) {
        MatMulColumns(x, w, rows, y, dims, begin, end);
      },
      kTile);
}

}  // namespace

void MatMul(const float* x, const void* w, DType w_dtype, float* y, const MatMulDims& dims,
            int threads) {
  VisitFloatDType(w_dtype, [&](auto tag) {
    using WeightT = decltype(tag);
    MatMulParallel(x, static_cast<const WeightT*>(w), PlainRows{}, y, dims, threads);
  });
}

void MatMulBlockScaled(const float* x, const F8E4M3* w_fp8, const float* scale_inv, float* y,
                       const MatMulDims& dims, int threads) {
  const BlockScaledRows rows{
      .scale_inv = scale_inv,
      .scale_cols = (dims.k + kWeightScaleBlock - 1) / kWeightScaleBlock};
  MatMulParallel(x, w_fp8, rows, y, dims, threads);
}

}  // namespace nq::kernels::cpu
