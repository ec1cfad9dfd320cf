// CPU reference DSA indexer selection (contract in kernels/backend.h): for query t at position
// pos = start_pos + t, score[s] = sum_h weights[t, h] * relu(q[t, h, :] · k[s, :]) for s <= pos,
// then the top_k keys by (score descending, s ascending), written in ascending key order,
// padded with -1.
//
// Scores accumulate in double. The ordering is a strict total order (NaN scores rank as -inf,
// ties go to the lower key), so the selection is deterministic. Threads split the queries.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

// Below this many multiply-adds a call runs on one thread.
constexpr std::int64_t kParallelMinFmas = std::int64_t{1} << 20;

void SelectForQuery(const IndexerTopKParams& p, std::int64_t t, std::vector<double>& scores,
                    std::vector<std::int32_t>& order) {
  const std::int64_t visible = p.start_pos + t + 1;  // keys 0 .. pos
  const float* q = p.q + t * p.heads * p.dim;
  const float* w = p.weights + t * p.heads;
  scores.resize(visible);
  for (std::int64_t s = 0; s < visible; ++s) {
    const float* ks = p.k + s * p.dim;
    double score = 0.0;
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float* qh = q + h * p.dim;
      double dot = 0.0;
      for (std::int64_t i = 0; i < p.dim; ++i) dot += double{qh[i]} * ks[i];
      if (dot > 0.0) score += w[h] * dot;
    }
    scores[s] = std::isnan(score) ? -std::numeric_limits<double>::infinity() : score;
  }
  order.resize(visible);
  for (std::int64_t s = 0; s < visible; ++s) order[s] = static_cast<std::int32_t>(s);
  const std::int64_t take = std::min(p.top_k, visible);
  std::nth_element(order.begin(), order.begin() + (take - 1), order.end(),
                   [&](std::int32_t a, std::int32_t b) {
                     return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
                   });
  std::sort(order.begin(), order.begin() + take);
  std::int32_t* out = p.selected + t * p.top_k;
  for (std::int64_t k = 0; k < p.top_k; ++k) out[k] = k < take ? order[k] : -1;
}

}  // namespace

void IndexerTopK(const IndexerTopKParams& p, int threads) {
  const std::int64_t fmas = p.tokens * (p.start_pos + p.tokens) * p.heads * p.dim;
  const int use_threads = fmas < kParallelMinFmas ? 1 : threads;
  ParallelFor(p.tokens, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<double> scores;
    std::vector<std::int32_t> order;
    for (std::int64_t t = begin; t < end; ++t) SelectForQuery(p, t, scores, order);
  });
}

}  // namespace nq::kernels::cpu
