// The CPU backend's fp32 reference ops on raw row-major arrays. Arguments are already validated
// by Backend (kernels/backend.cc); these functions only compute.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace nq::kernels::cpu {

// y[m, n] = x[m, k] · w[n, k]^T; w holds `w_dtype` elements. Float accumulation.
void MatMul(const float* x, const void* w, DType w_dtype, float* y, const MatMulDims& dims,
            int threads);

// y[m, n] = x[m, k] · w[n, k]^T with w[j, p] = float(w_fp8[j, p]) * scale_inv[j / 128, p / 128]
// (one fp32 rounding per weight, kWeightScaleBlock = 128), then exactly as MatMul.
void MatMulBlockScaled(const float* x, const F8E4M3* w_fp8, const float* scale_inv, float* y,
                       const MatMulDims& dims, int threads);

// y = x * rsqrt(mean(x^2) + eps) * weight, per row; y may equal x. Double accumulation.
void RmsNorm(const float* x, const void* weight, DType weight_dtype, float eps, float* y,
             const RowDims& dims, int threads);

// y[r, j] = silu(x[r, j]) * x[r, cols + j]; x has 2 * dims.cols columns.
void SiluAndMul(const float* x, float* y, const RowDims& dims, int threads);

// y = softmax(scale * x) per row; all -inf rows give zeros; y may equal x.
void Softmax(const float* x, float scale, float* y, const RowDims& dims, int threads);

// ---- Model ops (contracts in kernels/backend.h) ----

// out[t, :] = table[ids[t], :] widened to fp32; table holds `table_dtype` rows of `dim`.
void Embedding(std::span<const std::int32_t> ids, const void* table, DType table_dtype,
               std::int64_t dim, float* out, int threads);

// out[i] = a[i] + b[i] for i < count; out may equal a or b.
void Add(const float* a, const float* b, float* out, std::int64_t count, int threads);

struct RopeParams {
  float* x = nullptr;  // [tokens, heads, dim], rotated in place
  std::int64_t tokens = 0;
  std::int64_t heads = 0;
  std::int64_t dim = 0;  // even; the head stride
  std::int64_t start_pos = 0;
  std::span<const float> inv_freq;  // r / 2 entries: the leading r <= dim elements rotate
  float attention_scaling = 1.0f;
  bool interleaved = false;
};
// Angles and cos/sin in float32 exactly as HF computes them; the rotation itself in double.
void Rope(const RopeParams& params, int threads);

// y = (x - mean) / sqrt(var + eps) * weight + bias per row (biased variance, double
// accumulation); y may equal x.
void LayerNorm(const float* x, const float* weight, const float* bias, float eps, float* y,
               const RowDims& dims, int threads);

// out[i] = bf16(src[i]) for `count` floats, rounded to nearest even (ToBf16): WriteRows into a
// BF16 KV cache.
void FloatsToBf16(const float* src, std::int64_t count, Bf16* out, int threads);

// out[i, :] = x[rows[i], :], rows of `cols` floats.
void GatherRows(const float* x, std::span<const std::int32_t> rows, std::int64_t cols, float* out,
                int threads);

// out[rows[i], :] += weights[i] * src[i, :] in index order (so repeated rows accumulate
// deterministically), rows of `cols` floats.
void ScatterAddRows(const float* src, std::span<const std::int32_t> rows,
                    std::span<const float> weights, std::int64_t cols, float* out, int threads);

struct MlaAttentionParams {
  const float* q_nope = nullptr;     // [tokens, heads, dn]
  const float* q_pe = nullptr;       // [tokens, heads, dr]
  const float* kv_latent = nullptr;  // [keys, c]
  const float* k_pe = nullptr;       // [keys, dr]
  const void* w_uk = nullptr;        // [heads, dn, c], elements of w_uk_dtype (F32 or BF16)
  DType w_uk_dtype = DType::kF32;
  const void* w_uv = nullptr;  // [heads, dv, c], elements of w_uv_dtype (F32 or BF16)
  DType w_uv_dtype = DType::kF32;
  const std::int32_t* selected = nullptr;  // [tokens, top_k], or null: every causal key
  float* out = nullptr;                    // [tokens, heads * dv]
  std::int64_t tokens = 0;
  std::int64_t heads = 0;
  std::int64_t dn = 0;
  std::int64_t dr = 0;
  std::int64_t c = 0;
  std::int64_t dv = 0;
  std::int64_t keys = 0;
  std::int64_t top_k = 0;  // columns of `selected`
  std::int64_t start_pos = 0;
  float scale = 1.0f;
};
// Absorbed MLA in fp32 (the serving path). Selected entries outside [0, start_pos + t] count as
// -1; a query with no visible key gets zeros. A query's output does not depend on the other
// queries of the call.
void MlaAttention(const MlaAttentionParams& params, int threads);
// The same in double (q_lat, the scores, the softmax and the latent output): the reference the
// fp32 kernel is tested against.
void MlaAttentionF64(const MlaAttentionParams& params, int threads);

struct IndexerTopKParams {
  const float* q = nullptr;        // [tokens, heads, dim]
  const float* k = nullptr;        // [keys, dim]
  const float* weights = nullptr;  // [tokens, heads]
  std::int32_t* selected = nullptr;  // [tokens, top_k]
  std::int64_t tokens = 0;
  std::int64_t heads = 0;
  std::int64_t dim = 0;
  std::int64_t keys = 0;
  std::int64_t top_k = 0;
  std::int64_t start_pos = 0;
};
// Scores in double; top_k by (score descending, key ascending), NaN scores ranking as -inf,
// written in ascending key order;
// -1 padding past the visible keys.
void IndexerTopK(const IndexerTopKParams& params, int threads);

}  // namespace nq::kernels::cpu
