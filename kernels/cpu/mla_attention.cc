// The CPU backend's multi-head latent attention in fp32, the serving path (contract in
// kernels/backend.h), in the absorbed form:
//   q_lat = q_nope · w_uk[h];  score_s = scale * (q_lat · kv_latent[s] + q_pe · k_pe[s]);
//   p = softmax(score) over the visible keys;  out = w_uv[h] · sum_s p_s kv_latent[s].
// mla_attention_f64.cc computes the same in double, the reference this kernel is tested against
// (tests/kernels/cpu/mla_attention_fp32_test.cc).
//
// Work items are (token, head) pairs; the process-wide pool (parallel.h) takes contiguous ranges
// of them. Within a range the heads of one token are processed together in groups of up to
// kHeadGroup, so each latent row kv_latent[s] is read once per group rather than once per head.
// Every dot product and axpy runs on 4-float vectors (vec4.h) in a fixed order, and a query's
// result depends only on its own inputs and keys: a decode call reproduces the rows of a prefill
// call bit for bit (speculative verification relies on it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/mla_keys.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec4.h"

namespace nq::kernels::cpu {
namespace {

// Heads sharing one pass over the keys; bounds the per-thread score buffer at kHeadGroup * keys.
constexpr std::int64_t kHeadGroup = 16;
// Below this many multiply-adds a call runs on one thread (a pool hand-off costs microseconds).
constexpr std::int64_t kParallelMinFmas = std::int64_t{1} << 20;

// Per-thread buffers, reused across the groups of a range.
struct Scratch {
  std::vector<std::int64_t> keys;
  std::vector<float> q_lat;   // [group, c]
  std::vector<float> scores;  // [group, keys]: scores, then unnormalised probabilities
  std::vector<float> o_lat;   // [group, c]
};

// Heads [h0, h0 + group) of token t.
template <typename UkT, typename UvT>
void AttendGroup(const MlaAttentionParams& p, std::int64_t t, std::int64_t h0, std::int64_t group,
                 Scratch& s) {
  const std::int64_t c = p.c;
  const std::int64_t n = static_cast<std::int64_t>(s.keys.size());
  const auto* w_uk = static_cast<const UkT*>(p.w_uk);
  const auto* w_uv = static_cast<const UvT*>(p.w_uv);
  s.q_lat.assign(group * c, 0.0f);
  s.scores.resize(group * n);
  s.o_lat.assign(group * c, 0.0f);

  // q_lat[g, :] = q_nope[t, h, :] · w_uk[h]  ([dn] x [dn, c]), one axpy per row of w_uk.
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = h0 + g;
    const float* qn = p.q_nope + (t * p.heads + h) * p.dn;
    for (std::int64_t j = 0; j < p.dn; ++j) {
      Axpy(qn[j], w_uk + (h * p.dn + j) * c, s.q_lat.data() + g * c, c);
    }
  }

  // Scores, key-major so each latent row serves the whole group.
  for (std::int64_t i = 0; i < n; ++i) {
    const float* kv = p.kv_latent + s.keys[i] * c;
    const float* kp = p.k_pe + s.keys[i] * p.dr;
    for (std::int64_t g = 0; g < group; ++g) {
      const float* qp = p.q_pe + (t * p.heads + h0 + g) * p.dr;
      s.scores[g * n + i] = p.scale * (Dot(s.q_lat.data() + g * c, kv, c) + Dot(qp, kp, p.dr));
    }
  }

  // Stable softmax per head: exp(score - max), normalised at the output.
  float inv_sum[kHeadGroup];
  for (std::int64_t g = 0; g < group; ++g) {
    float* sg = s.scores.data() + g * n;
    float max = -std::numeric_limits<float>::infinity();
    for (std::int64_t i = 0; i < n; ++i) max = std::max(max, sg[i]);
    float sum = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - max);
      sum += sg[i];
    }
    inv_sum[g] = n > 0 ? 1.0f / sum : 0.0f;
  }

  // o_lat[g, :] = sum_s p[g, s] kv_latent[s, :].
  for (std::int64_t i = 0; i < n; ++i) {
    const float* kv = p.kv_latent + s.keys[i] * c;
    for (std::int64_t g = 0; g < group; ++g) Axpy(s.scores[g * n + i], kv, s.o_lat.data() + g * c, c);
  }

  // out[t, h*dv + v] = w_uv[h, v, :] · o_lat[g, :] / sum.
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = h0 + g;
    const float* ol = s.o_lat.data() + g * c;
    float* out = p.out + t * p.heads * p.dv + h * p.dv;
    for (std::int64_t v = 0; v < p.dv; ++v) {
      out[v] = Dot(ol, w_uv + (h * p.dv + v) * c, c) * inv_sum[g];
    }
  }
}

template <typename UkT, typename UvT>
void AttendRange(const MlaAttentionParams& p, std::int64_t begin, std::int64_t end) {
  Scratch scratch;
  std::int64_t item = begin;
  while (item < end) {
    const std::int64_t t = item / p.heads;
    const std::int64_t h0 = item % p.heads;
    const std::int64_t group = std::min({kHeadGroup, p.heads - h0, end - item});
    if (h0 == 0 || item == begin) VisibleKeys(p, t, scratch.keys);
    AttendGroup<UkT, UvT>(p, t, h0, group, scratch);
    item += group;
  }
}

}  // namespace

void MlaAttention(const MlaAttentionParams& p, int threads) {
  const int use_threads = MlaAttentionFmas(p) < kParallelMinFmas ? 1 : threads;
  VisitFloatDType(p.w_uk_dtype, [&](auto uk_tag) {
    VisitFloatDType(p.w_uv_dtype, [&](auto uv_tag) {
      using UkT = decltype(uk_tag);
      using UvT = decltype(uv_tag);
      ParallelFor(p.tokens * p.heads, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
        AttendRange<UkT, UvT>(p, begin, end);
      });
    });
  });
}

}  // namespace nq::kernels::cpu
