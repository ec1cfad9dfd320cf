#include "tests/kernels/model_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "kernels/kv_fp8.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels::testing {

std::vector<double> RefRope(std::span<const float> x, std::int64_t tokens, std::int64_t heads,
                            std::int64_t dim, std::int64_t start_pos,
                            std::span<const float> inv_freq, float attention_scaling,
                            bool interleaved, bool float_angle) {
  std::vector<double> y(x.begin(), x.end());
  const std::int64_t half = dim / 2;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t position = start_pos + t;
    for (std::int64_t i = 0; i < half; ++i) {
      double cos = 0.0;
      double sin = 0.0;
      if (float_angle) {
        const float angle = inv_freq[i] * static_cast<float>(position);
        cos = std::cos(angle) * attention_scaling;
        sin = std::sin(angle) * attention_scaling;
      } else {
        const double angle = double{inv_freq[i]} * static_cast<double>(position);
        cos = std::cos(angle) * attention_scaling;
        sin = std::sin(angle) * attention_scaling;
      }
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t base = (t * heads + h) * dim;
        const std::int64_t a = base + (interleaved ? 2 * i : i);
        const std::int64_t b = base + (interleaved ? 2 * i + 1 : i + half);
        y[a] = double{x[a]} * cos - double{x[b]} * sin;
        y[b] = double{x[b]} * cos + double{x[a]} * sin;
      }
    }
  }
  return y;
}

std::vector<double> RefLayerNorm(std::span<const float> x, std::span<const float> weight,
                                 std::span<const float> bias, std::int64_t rows, std::int64_t cols,
                                 double eps) {
  std::vector<double> y(rows * cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= cols;
    double var = 0.0;
    for (std::int64_t c = 0; c < cols; ++c)
      var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    var /= cols;
    for (std::int64_t c = 0; c < cols; ++c) {
      y[r * cols + c] = (x[r * cols + c] - mean) / std::sqrt(var + eps) * weight[c] + bias[c];
    }
  }
  return y;
}

std::vector<double> RefMlaAttention(const MlaShape& m, const MlaInputs& in,
                                    std::span<const std::int32_t> selected, std::int64_t top_k,
                                    double scale) {
  // Decompressed keys and values, as HF's kv_b_proj produces them.
  std::vector<double> k_nope(m.keys * m.heads * m.dn, 0.0);
  std::vector<double> v(m.keys * m.heads * m.dv, 0.0);
  for (std::int64_t s = 0; s < m.keys; ++s) {
    for (std::int64_t h = 0; h < m.heads; ++h) {
      for (std::int64_t j = 0; j < m.dn; ++j) {
        double sum = 0.0;
        for (std::int64_t i = 0; i < m.c; ++i) {
          sum += double{in.w_uk[(h * m.dn + j) * m.c + i]} * in.kv_latent[s * m.c + i];
        }
        k_nope[(s * m.heads + h) * m.dn + j] = sum;
      }
      for (std::int64_t j = 0; j < m.dv; ++j) {
        double sum = 0.0;
        for (std::int64_t i = 0; i < m.c; ++i) {
          sum += double{in.w_uv[(h * m.dv + j) * m.c + i]} * in.kv_latent[s * m.c + i];
        }
        v[(s * m.heads + h) * m.dv + j] = sum;
      }
    }
  }
  std::vector<double> out(m.tokens * m.heads * m.dv, 0.0);
  std::vector<double> scores(m.keys);
  for (std::int64_t t = 0; t < m.tokens; ++t) {
    const std::int64_t pos = m.start_pos + t;
    std::vector<bool> allowed(m.keys, selected.empty());
    if (!selected.empty()) {
      for (std::int64_t k = 0; k < top_k; ++k) {
        const std::int32_t s = selected[t * top_k + k];
        if (s >= 0 && s < m.keys) allowed[s] = true;
      }
    }
    for (std::int64_t h = 0; h < m.heads; ++h) {
      double max = -std::numeric_limits<double>::infinity();
      for (std::int64_t s = 0; s < m.keys; ++s) {
        scores[s] = -std::numeric_limits<double>::infinity();
        if (s > pos || !allowed[s]) continue;
        double dot = 0.0;
        for (std::int64_t j = 0; j < m.dn; ++j) {
          dot += in.q_nope[(t * m.heads + h) * m.dn + j] * k_nope[(s * m.heads + h) * m.dn + j];
        }
        for (std::int64_t j = 0; j < m.dr; ++j) {
          dot += double{in.q_pe[(t * m.heads + h) * m.dr + j]} * in.k_pe[s * m.dr + j];
        }
        scores[s] = scale * dot;
        max = std::max(max, scores[s]);
      }
      if (std::isinf(max)) continue;  // nothing visible: zeros
      double sum = 0.0;
      for (std::int64_t s = 0; s < m.keys; ++s) sum += std::exp(scores[s] - max);
      for (std::int64_t s = 0; s < m.keys; ++s) {
        const double p = std::exp(scores[s] - max) / sum;
        for (std::int64_t j = 0; j < m.dv; ++j) {
          out[(t * m.heads + h) * m.dv + j] += p * v[(s * m.heads + h) * m.dv + j];
        }
      }
    }
  }
  return out;
}

std::vector<double> RefIndexerScores(std::span<const float> q, std::span<const float> k,
                                     std::span<const float> weights, std::int64_t heads,
                                     std::int64_t dim, std::int64_t start_pos, std::int64_t t) {
  std::vector<double> scores(start_pos + t + 1, 0.0);
  for (std::size_t s = 0; s < scores.size(); ++s) {
    for (std::int64_t h = 0; h < heads; ++h) {
      double dot = 0.0;
      for (std::int64_t i = 0; i < dim; ++i) {
        dot += double{q[(t * heads + h) * dim + i]} * k[s * dim + i];
      }
      scores[s] += weights[t * heads + h] * std::max(dot, 0.0);
    }
  }
  return scores;
}

std::vector<std::int32_t> RefIndexerTopK(std::span<const float> q, std::span<const float> k,
                                         std::span<const float> weights, std::int64_t tokens,
                                         std::int64_t heads, std::int64_t dim,
                                         std::int64_t start_pos, std::int64_t top_k) {
  std::vector<std::int32_t> selected(tokens * top_k, -1);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::vector<double> scores = RefIndexerScores(q, k, weights, heads, dim, start_pos, t);
    std::vector<bool> taken(scores.size(), false);
    for (std::int64_t j = 0; j < top_k && j < static_cast<std::int64_t>(scores.size()); ++j) {
      std::int64_t best = -1;
      for (std::size_t s = 0; s < scores.size(); ++s) {
        if (!taken[s] && (best < 0 || scores[s] > scores[best]))
          best = static_cast<std::int64_t>(s);
      }
      taken[best] = true;
    }
    // The contract's order: ascending keys.
    std::int64_t j = 0;
    for (std::size_t s = 0; s < scores.size(); ++s) {
      if (taken[s]) selected[t * top_k + j++] = static_cast<std::int32_t>(s);
    }
  }
  return selected;
}

MlaInputs RandomMlaInputs(std::mt19937_64& rng, const MlaShape& m, DType w_uk_dtype,
                          DType w_uv_dtype, float weight_sd) {
  MlaInputs in;
  in.q_nope = RandomNormal(rng, m.tokens * m.heads * m.dn, 1.0f);
  in.q_pe = RandomNormal(rng, m.tokens * m.heads * m.dr, 1.0f);
  in.kv_latent = RandomNormal(rng, m.keys * m.c, 1.0f);
  in.k_pe = RandomNormal(rng, m.keys * m.dr, 1.0f);
  in.w_uk = RoundTo(w_uk_dtype, RandomNormal(rng, m.heads * m.dn * m.c, weight_sd));
  in.w_uv = RoundTo(w_uv_dtype, RandomNormal(rng, m.heads * m.dv * m.c, weight_sd));
  return in;
}

std::vector<float> RunMlaAttention(Backend& backend, const MlaShape& m, const MlaInputs& in,
                                   DType w_uk_dtype, DType w_uv_dtype,
                                   std::span<const std::int32_t> selected, std::int64_t top_k,
                                   float scale, DType kv_dtype, std::int64_t position_bound) {
  Tensor q_nope = Upload(backend, in.q_nope, DType::kF32, {m.tokens, m.heads, m.dn});
  Tensor q_pe = Upload(backend, in.q_pe, DType::kF32, {m.tokens, m.heads, m.dr});
  // An FP8 cache: the latent as packed rows (kernels/kv_fp8.h), the rope key in BF16.
  Tensor kv_latent, k_pe;
  if (kv_dtype == DType::kF8E4M3) {
    std::vector<std::uint8_t> rows(static_cast<std::size_t>(m.keys * KvFp8RowBytes(m.c)));
    for (std::int64_t s = 0; s < m.keys; ++s) {
      PackKvFp8Row(in.kv_latent.data() + s * m.c, m.c, rows.data() + s * KvFp8RowBytes(m.c));
    }
    kv_latent = UploadBytes(backend, rows, DType::kU8, {m.keys, KvFp8RowBytes(m.c)});
    k_pe = Upload(backend, in.k_pe, DType::kBF16, {m.keys, m.dr});
  } else {
    kv_latent = Upload(backend, in.kv_latent, kv_dtype, {m.keys, m.c});
    k_pe = Upload(backend, in.k_pe, kv_dtype, {m.keys, m.dr});
  }
  Tensor w_uk = Upload(backend, in.w_uk, w_uk_dtype, {m.heads, m.dn, m.c});
  Tensor w_uv = Upload(backend, in.w_uv, w_uv_dtype, {m.heads, m.dv, m.c});
  Tensor out = AllocateOrFail(backend, DType::kF32, {m.tokens, m.heads * m.dv});
  Tensor sel;
  if (!selected.empty()) sel = UploadI32(backend, selected, {m.tokens, top_k});
  const std::int32_t position = static_cast<std::int32_t>(m.start_pos);
  Tensor device_position = UploadI32(backend, std::span<const std::int32_t>(&position, 1), {1});
  const StepPosition start =
      position_bound < 0 ? StepPosition(m.start_pos) : StepPosition::OnDevice(device_position, position_bound);
  const absl::Status status =
      backend.MlaAttention(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv,
                           selected.empty() ? nullptr : &sel, start, scale, out);
  if (!status.ok()) {
    ADD_FAILURE() << backend.name() << " MlaAttention: " << status;
    return {};
  }
  return Download(backend, out);
}

std::vector<std::int32_t> RunIndexerTopK(Backend& backend, std::span<const float> q,
                                         std::span<const float> k, std::span<const float> weights,
                                         std::int64_t tokens, std::int64_t heads, std::int64_t dim,
                                         std::int64_t keys, std::int64_t start_pos,
                                         std::int64_t top_k, std::int64_t position_bound) {
  Tensor tq = Upload(backend, q, DType::kF32, {tokens, heads, dim});
  Tensor tk = Upload(backend, k, DType::kF32, {keys, dim});
  Tensor tw = Upload(backend, weights, DType::kF32, {tokens, heads});
  Tensor selected = AllocateOrFail(backend, DType::kI32, {tokens, top_k});
  const std::int32_t position = static_cast<std::int32_t>(start_pos);
  Tensor device_position = UploadI32(backend, std::span<const std::int32_t>(&position, 1), {1});
  const StepPosition start =
      position_bound < 0 ? StepPosition(start_pos) : StepPosition::OnDevice(device_position, position_bound);
  const absl::Status status = backend.IndexerTopK(tq, tk, tw, start, selected);
  if (!status.ok()) {
    ADD_FAILURE() << backend.name() << " IndexerTopK: " << status;
    return {};
  }
  return DownloadI32(backend, selected);
}

}  // namespace nq::kernels::testing
