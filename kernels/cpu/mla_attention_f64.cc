// The float64 reference of the CPU backend's multi-head latent attention (contract in
// kernels/backend.h), in the absorbed form:
//   q_lat = q_nope · w_uk[h];  score_s = scale * (q_lat · kv_latent[s] + q_pe · k_pe[s]);
//   p = softmax(score) over the visible keys;  out = w_uv[h] · sum_s p_s kv_latent[s].
//
// q_lat, the scores, the softmax and the latent output are held in double: this is the oracle the
// fp32 serving kernel (mla_attention.cc) is tested against, and what a backend made with
// BackendOptions::cpu_float64_attention runs (tests that compare with HF's float64 reference at
// a few fp32 ulps). Work items and head groups as in mla_attention.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/mla_keys.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

// Heads sharing one pass over the keys; bounds the per-thread score buffer at kHeadGroup * keys.
constexpr std::int64_t kHeadGroup = 16;
// Below this many multiply-adds a call runs on one thread.
constexpr std::int64_t kParallelMinFmas = std::int64_t{1} << 20;

double Dot(const double* a, const float* b, std::int64_t n) {
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Heads [h0, h0 + group) of token t.
template <typename UkT, typename UvT>
void AttendGroup(const MlaAttentionParams& p, std::int64_t t, std::int64_t h0, std::int64_t group,
                 const std::vector<std::int64_t>& keys, std::vector<double>& q_lat,
                 std::vector<double>& q_pe, std::vector<double>& scores,
                 std::vector<double>& o_lat) {
  const std::int64_t c = p.c;
  const std::int64_t n = static_cast<std::int64_t>(keys.size());
  const auto* w_uk = static_cast<const UkT*>(p.w_uk);
  const auto* w_uv = static_cast<const UvT*>(p.w_uv);
  q_lat.assign(group * c, 0.0);
  q_pe.resize(group * p.dr);
  scores.resize(group * n);
  o_lat.assign(group * c, 0.0);

  // q_lat[g, :] = q_nope[t, h, :] · w_uk[h]  ([dn] x [dn, c]), row by row of w_uk.
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = h0 + g;
    const float* qn = p.q_nope + (t * p.heads + h) * p.dn;
    double* ql = q_lat.data() + g * c;
    for (std::int64_t j = 0; j < p.dn; ++j) {
      const double qv = qn[j];
      const UkT* w_row = w_uk + (h * p.dn + j) * c;
      for (std::int64_t i = 0; i < c; ++i) ql[i] += qv * ToFloat(w_row[i]);
    }
    const float* qp = p.q_pe + (t * p.heads + h) * p.dr;
    for (std::int64_t i = 0; i < p.dr; ++i) q_pe[g * p.dr + i] = qp[i];
  }

  // Scores, key-major so each latent row serves the whole group.
  for (std::int64_t i = 0; i < n; ++i) {
    const float* kv = p.kv_latent + keys[i] * c;
    const float* kp = p.k_pe + keys[i] * p.dr;
    for (std::int64_t g = 0; g < group; ++g) {
      scores[g * n + i] =
          p.scale * (Dot(q_lat.data() + g * c, kv, c) + Dot(q_pe.data() + g * p.dr, kp, p.dr));
    }
  }

  // Stable softmax per head; the scores become probabilities.
  std::vector<double> inv_sum(group, 0.0);
  for (std::int64_t g = 0; g < group; ++g) {
    double* sg = scores.data() + g * n;
    double max = -std::numeric_limits<double>::infinity();
    for (std::int64_t i = 0; i < n; ++i) max = std::max(max, sg[i]);
    double sum = 0.0;
    for (std::int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - max);
      sum += sg[i];
    }
    inv_sum[g] = n > 0 ? 1.0 / sum : 0.0;
  }

  // o_lat[g, :] = sum_s p[g, s] kv_latent[s, :].
  for (std::int64_t i = 0; i < n; ++i) {
    const float* kv = p.kv_latent + keys[i] * c;
    for (std::int64_t g = 0; g < group; ++g) {
      const double pg = scores[g * n + i];
      double* ol = o_lat.data() + g * c;
      for (std::int64_t j = 0; j < c; ++j) ol[j] += pg * kv[j];
    }
  }

  // out[t, h*dv + v] = w_uv[h, v, :] · o_lat[g, :] / sum.
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = h0 + g;
    const double* ol = o_lat.data() + g * c;
    float* out = p.out + t * p.heads * p.dv + h * p.dv;
    for (std::int64_t v = 0; v < p.dv; ++v) {
      const UvT* w_row = w_uv + (h * p.dv + v) * c;
      double sum = 0.0;
      for (std::int64_t j = 0; j < c; ++j) sum += ToFloat(w_row[j]) * ol[j];
      out[v] = static_cast<float>(sum * inv_sum[g]);
    }
  }
}

template <typename UkT, typename UvT>
void AttendRange(const MlaAttentionParams& p, std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> keys;
  std::vector<double> q_lat, q_pe, scores, o_lat;
  std::int64_t item = begin;
  while (item < end) {
    const std::int64_t t = item / p.heads;
    const std::int64_t h0 = item % p.heads;
    const std::int64_t group = std::min({kHeadGroup, p.heads - h0, end - item});
    if (h0 == 0 || item == begin) VisibleKeys(p, t, keys);
    AttendGroup<UkT, UvT>(p, t, h0, group, keys, q_lat, q_pe, scores, o_lat);
    item += group;
  }
}

}  // namespace

void MlaAttentionF64(const MlaAttentionParams& p, int threads) {
  const std::int64_t items = p.tokens * p.heads;
  const int use_threads = MlaAttentionFmas(p) < kParallelMinFmas ? 1 : threads;
  VisitFloatDType(p.w_uk_dtype, [&](auto uk_tag) {
    VisitFloatDType(p.w_uv_dtype, [&](auto uv_tag) {
      using UkT = decltype(uk_tag);
      using UvT = decltype(uv_tag);
      ParallelFor(items, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
        AttendRange<UkT, UvT>(p, begin, end);
      });
    });
  });
}

}  // namespace nq::kernels::cpu
