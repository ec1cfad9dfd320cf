// Naive double-precision references for the model ops (Backend's MLA / DSA / MoE graph ops),
// written the way HF writes them rather than the way the kernels do: MLA decompresses per-head
// keys and values instead of absorbing w_uk / w_uv, the indexer selects by repeated argmax.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kernels/backend.h"

namespace nq::kernels::testing {

// x[tokens, heads, dim] rotated as HF does: angle = float32(inv_freq[i] * float32(position)),
// cos/sin in float32 times attention_scaling in float32, the rotation in double.
// `float_angle` = false computes the angle and cos/sin in double instead (to show the
// difference matters).
std::vector<double> RefRope(std::span<const float> x, std::int64_t tokens, std::int64_t heads,
                            std::int64_t dim, std::int64_t start_pos,
                            std::span<const float> inv_freq, float attention_scaling,
                            bool interleaved, bool float_angle = true);

std::vector<double> RefLayerNorm(std::span<const float> x, std::span<const float> weight,
                                 std::span<const float> bias, std::int64_t rows, std::int64_t cols,
                                 double eps);

struct MlaShape {
  std::int64_t tokens = 0;
  std::int64_t heads = 0;
  std::int64_t dn = 0;  // no-rope query/key dim
  std::int64_t dr = 0;  // rope dim
  std::int64_t c = 0;   // latent (kv_lora_rank)
  std::int64_t dv = 0;  // value head dim
  std::int64_t keys = 0;
  std::int64_t start_pos = 0;
};

struct MlaInputs {
  std::vector<float> q_nope;     // [tokens, heads, dn]
  std::vector<float> q_pe;       // [tokens, heads, dr]
  std::vector<float> kv_latent;  // [keys, c]
  std::vector<float> k_pe;       // [keys, dr]
  std::vector<float> w_uk;       // [heads, dn, c]
  std::vector<float> w_uv;       // [heads, dv, c]
};

// out[tokens, heads * dv] by the non-absorbed MLA of HF's DeepseekV3Attention: k_nope[s, h] =
// w_uk[h] · kv_latent[s], v[s, h] = w_uv[h] · kv_latent[s], causal softmax; when `selected`
// ([tokens, top_k], -1 = none) is non-empty only its visible keys count. A query with no
// visible key gives zeros.
std::vector<double> RefMlaAttention(const MlaShape& shape, const MlaInputs& in,
                                    std::span<const std::int32_t> selected, std::int64_t top_k,
                                    double scale);

// The indexer scores of query t for its visible keys s <= start_pos + t, in double.
std::vector<double> RefIndexerScores(std::span<const float> q, std::span<const float> k,
                                     std::span<const float> weights, std::int64_t heads,
                                     std::int64_t dim, std::int64_t start_pos, std::int64_t t);

// selected[tokens, top_k] by repeated argmax over RefIndexerScores (first maximum wins, so ties
// go to the lower key), -1 once the visible keys run out.
std::vector<std::int32_t> RefIndexerTopK(std::span<const float> q, std::span<const float> k,
                                         std::span<const float> weights, std::int64_t tokens,
                                         std::int64_t heads, std::int64_t dim,
                                         std::int64_t start_pos, std::int64_t top_k);

// ---- Inputs and runners shared by the CPU and CUDA tests ----

// Random MLA inputs: activations N(0, 1), weights N(0, weight_sd^2) rounded to their dtypes.
MlaInputs RandomMlaInputs(std::mt19937_64& rng, const MlaShape& shape, DType w_uk_dtype,
                          DType w_uv_dtype, float weight_sd = 0.1f);

// Backend::MlaAttention on fresh tensors of `backend` (the cache uploaded as kv_dtype); `selected`
// empty = dense. position_bound >= 0 passes the start position as a device tensor with that
// bound (kernels/step_position.h) instead of a host value. Returns out (empty, with a test
// failure, if the op fails).
std::vector<float> RunMlaAttention(Backend& backend, const MlaShape& shape, const MlaInputs& in,
                                   DType w_uk_dtype, DType w_uv_dtype,
                                   std::span<const std::int32_t> selected, std::int64_t top_k,
                                   float scale, DType kv_dtype = DType::kF32, std::int64_t position_bound = -1);

// Backend::IndexerTopK on fresh tensors of `backend`: q [tokens, heads, dim], k [keys, dim],
// weights [tokens, heads]; position_bound as RunMlaAttention's. Returns selected (empty, with a
// test failure, if the op fails).
std::vector<std::int32_t> RunIndexerTopK(Backend& backend, std::span<const float> q,
                                         std::span<const float> k, std::span<const float> weights,
                                         std::int64_t tokens, std::int64_t heads, std::int64_t dim,
                                         std::int64_t keys, std::int64_t start_pos,
                                         std::int64_t top_k, std::int64_t position_bound = -1);

}  // namespace nq::kernels::testing
