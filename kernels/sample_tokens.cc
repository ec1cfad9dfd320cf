#include "kernels/sample_tokens.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace nq::kernels {

const char* SampleParamsError(const SampleParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0) return "temperature must be finite and >= 0";
  if (!(p.top_p > 0 && p.top_p <= 1)) return "top_p must be in (0, 1]";
  if (p.top_k < 0) return "top_k must be >= 0";
  if (!(p.u01 >= 0 && p.u01 < 1)) return "u01 must be in [0, 1)";
  return "";
}

std::int32_t SampleRowHost(std::span<const float> logits, const SampleParams& p) {
  const std::int64_t V = static_cast<std::int64_t>(logits.size());
  std::int64_t best = -1;
  for (std::int64_t i = 0; i < V; ++i) {
    const float l = logits[static_cast<size_t>(i)];
    if (std::isfinite(l) && (best < 0 || l > logits[static_cast<size_t>(best)])) best = i;
  }
  if (best < 0) return kNoFiniteLogit;
  if (p.temperature == 0) return static_cast<std::int32_t>(best);
  const float max_logit = logits[static_cast<size_t>(best)];
  const float inv_t = 1.0f / p.temperature;
  auto weight = [&](std::int64_t i) {
    const float l = logits[static_cast<size_t>(i)];
    return std::isfinite(l) ? SampleWeight(l, max_logit, inv_t) : 0;
  };
  // The whole order (a reference, not a fast path): descending key, ties by id.
  std::vector<std::int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    const std::uint32_t ka = SampleKey(logits[static_cast<size_t>(a)]);
    const std::uint32_t kb = SampleKey(logits[static_cast<size_t>(b)]);
    return ka > kb || (ka == kb && a < b);
  });
  // The first position of order[0, n) whose inclusive weight exceeds `point`, or -1.
  auto first_beyond = [&](std::int64_t n, std::uint64_t point) -> std::int64_t {
    std::uint64_t cum = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      cum += weight(order[static_cast<size_t>(j)]);
      if (cum > point) return j;
    }
    return -1;
  };
  auto total = [&](std::int64_t n) {
    std::uint64_t sum = 0;
    for (std::int64_t j = 0; j < n; ++j) sum += weight(order[static_cast<size_t>(j)]);
    return sum;
  };
  std::int64_t kept = V;
  if (p.top_k > 0 && p.top_k < V) kept = p.top_k;
  if (p.top_p < 1) {
    const std::int64_t at = first_beyond(kept, SampleTopPPoint(p.top_p, total(V)));
    if (at >= 0) kept = at + 1;
  }
  const std::int64_t at = first_beyond(kept, SampleDrawPoint(p.u01, total(kept)));
  return order[static_cast<size_t>(at)];  // the point is below the kept total: always found
}

}  // namespace nq::kernels
