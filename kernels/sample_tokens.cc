#include "kernels/sample_tokens.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

namespace nq::kernels {

namespace {

// The ids in play: key > cut.key, or key == cut.key and id <= cut.id (a prefix of the order).
struct Cut {
  std::uint32_t key = 0;
  std::int32_t id = std::numeric_limits<std::int32_t>::max();
};

bool InCut(std::uint32_t key, std::int32_t id, const Cut& cut) {
  return key > cut.key || (key == cut.key && id <= cut.id);
}

// The logit of a non-zero key (SampleKey's inverse).
float KeyLogit(std::uint32_t key) { return BitsToFloat((key & 0x80000000u) != 0 ? key & 0x7fffffffu : ~key); }

enum class Point { kGiven, kGivenIfReached, kFraction };

// The greedy pick: the largest finite logit's id (ties: the lower id), or -1.
std::int64_t LargestFinite(std::span<const float> logits) {
  std::int64_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (std::isfinite(l) && (best < 0 || l > logits[static_cast<size_t>(best)])) best = static_cast<std::int64_t>(i);
  }
  return best;
}

// One row's keys and weights, and the radix selection the CUDA kernel runs (one pass here per
// pass there, the same digits, the same tie rule).
class RowSelector {
 public:
  RowSelector(std::span<const float> logits, float max_logit, float inv_temperature)
      : max_logit_(max_logit), inv_temperature_(inv_temperature), keys_(logits.size()), weights_(logits.size()) {
    for (size_t i = 0; i < logits.size(); ++i) {
      keys_[i] = SampleKey(logits[i]);
      weights_[i] = keys_[i] == 0 ? 0 : SampleWeight(logits[i], max_logit, inv_temperature);
    }
  }

  std::uint64_t TotalWeight() const {
    std::uint64_t sum = 0;
    for (const std::uint64_t w : weights_) sum += w;
    return sum;
  }

  // The first id in play, in descending order, whose running weight (count when !by_weight)
  // exceeds the point; nullopt for kGivenIfReached when the ids in play weigh no more than it.
  std::optional<Cut> Select(bool by_weight, const Cut& cut, Point kind, std::uint64_t point, double fraction) const {
    std::uint32_t prefix = 0;
    int prefix_bits = 0;
    std::uint64_t u = point, final_weight = 0;
    std::int32_t final_min_id = 0;
    std::vector<std::uint64_t> hist;
    std::vector<std::int32_t> min_id;
    for (int pass = 0; pass < 3; ++pass) {
      const int bits = pass < 2 ? 11 : 10;
      const std::uint32_t bins = 1u << bits;
      const int shift = 32 - prefix_bits - bits;
      hist.assign(bins, 0);
      min_id.assign(bins, std::numeric_limits<std::int32_t>::max());
      for (size_t i = 0; i < keys_.size(); ++i) {
        const std::uint32_t key = keys_[i];
        const auto id = static_cast<std::int32_t>(i);
        if (!InCut(key, id, cut)) continue;
        if (prefix_bits > 0 && (key >> (32 - prefix_bits)) != prefix) continue;
        const std::uint64_t w = by_weight ? weights_[i] : 1;
        if (w == 0) continue;
        const std::uint32_t d = (key >> shift) & (bins - 1);
        hist[d] += w;
        min_id[d] = std::min(min_id[d], id);
      }
      std::uint64_t total = 0;
      for (const std::uint64_t h : hist) total += h;
      if (pass == 0) {
        if (kind == Point::kFraction) u = SampleDrawPoint(fraction, total);
        if (kind == Point::kGivenIfReached && total <= u) return std::nullopt;
      }
      std::uint64_t before = 0;
      std::uint32_t digit = bins - 1;
      for (std::uint32_t d = bins; d-- > 0;) {
        if (before <= u && u < before + hist[d]) {
          digit = d;
          break;
        }
        before += hist[d];
      }
      u -= before;
      prefix = (prefix << bits) | digit;
      prefix_bits += bits;
      final_weight = hist[digit];
      final_min_id = min_id[digit];
    }
    const std::uint64_t w = by_weight ? SampleWeight(KeyLogit(prefix), max_logit_, inv_temperature_) : 1;
    const std::uint64_t ties = final_weight / w, j = u / w;
    if (ties == 1) return Cut{prefix, final_min_id};
    std::uint64_t seen = 0;
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] != prefix || !InCut(prefix, static_cast<std::int32_t>(i), cut)) continue;
      if (seen++ == j) return Cut{prefix, static_cast<std::int32_t>(i)};
    }
    return std::nullopt;  // unreachable: j < ties
  }

 private:
  float max_logit_;
  float inv_temperature_;
  std::vector<std::uint32_t> keys_;
  std::vector<std::uint64_t> weights_;
};

}  // namespace

const char* SampleParamsError(const SampleParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0) return "temperature must be finite and >= 0";
  if (!(p.top_p > 0 && p.top_p <= 1)) return "top_p must be in (0, 1]";
  if (p.top_k < 0) return "top_k must be >= 0";
  if (!(p.u01 >= 0 && p.u01 < 1)) return "u01 must be in [0, 1)";
  return "";
}

std::int32_t SampleRowBySort(std::span<const float> logits, const SampleParams& p) {
  const std::int64_t V = static_cast<std::int64_t>(logits.size());
  const std::int64_t best = LargestFinite(logits);
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

std::int32_t SampleRowHost(std::span<const float> logits, const SampleParams& p) {
  const std::int64_t V = static_cast<std::int64_t>(logits.size());
  const std::int64_t best = LargestFinite(logits);
  if (best < 0) return kNoFiniteLogit;
  if (p.temperature == 0) return static_cast<std::int32_t>(best);
  const RowSelector row(logits, logits[static_cast<size_t>(best)], 1.0f / p.temperature);
  Cut cut;
  if (p.top_k > 0 && p.top_k < V) {
    cut = *row.Select(/*by_weight=*/false, cut, Point::kGiven, static_cast<std::uint64_t>(p.top_k - 1), 0);
  }
  if (p.top_p < 1) {
    const std::uint64_t point = SampleTopPPoint(p.top_p, row.TotalWeight());
    if (std::optional<Cut> nucleus = row.Select(/*by_weight=*/true, cut, Point::kGivenIfReached, point, 0)) {
      cut = *nucleus;
    }
  }
  return row.Select(/*by_weight=*/true, cut, Point::kFraction, 0, p.u01)->id;
}

}  // namespace nq::kernels
