#include "services/worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace nq::worker {

absl::StatusOr<Sampler> Sampler::Create(const SamplingConfig& c) {
  if (!std::isfinite(c.temperature) || c.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature ", c.temperature, " must be >= 0"));
  }
  if (!(c.top_p > 0 && c.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p ", c.top_p, " must be in (0, 1]"));
  }
  if (c.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k ", c.top_k, " must be >= 0"));
  if (c.top_logprobs < 0 || c.top_logprobs > 20) {
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs ", c.top_logprobs, " must be in 0..20"));
  }
  // OpenAI's documented ranges.
  constexpr float kMaxPenalty = 2.0f;
  constexpr float kMaxBias = 100.0f;
  for (const auto& [name, value] : {std::pair{"presence_penalty", c.presence_penalty},
                                    std::pair{"frequency_penalty", c.frequency_penalty}}) {
    if (!(std::abs(value) <= kMaxPenalty)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " ", value, " must be in [-2, 2]"));
    }
  }
  for (const auto& [id, bias] : c.logit_bias) {
    if (id < 0) return absl::InvalidArgumentError(absl::StrCat("logit_bias token id ", id, " must be >= 0"));
    if (!(std::abs(bias) <= kMaxBias)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias for token ", id, " is ", bias,
                                                     "; it must be in [-100, 100]"));
    }
  }
  return Sampler(c);
}

std::span<const float> Sampler::Adjust(std::span<const float> logits) {
  const bool penalised = !counts_.empty() && (config_.presence_penalty != 0 || config_.frequency_penalty != 0);
  if (config_.logit_bias.empty() && !penalised) return logits;
  adjusted_.assign(logits.begin(), logits.end());
  for (const auto& [id, bias] : config_.logit_bias) adjusted_[static_cast<size_t>(id)] += bias;
  if (penalised) {
    for (const auto& [id, count] : counts_) {
      adjusted_[static_cast<size_t>(id)] -= config_.frequency_penalty * static_cast<float>(count) + config_.presence_penalty;
    }
  }
  return adjusted_;
}

void Sampler::Count(int32_t id) { ++counts_[id]; }

absl::StatusOr<SampledToken> Sampler::Sample(std::span<const float> raw_logits) {
  for (const auto& [id, bias] : config_.logit_bias) {
    if (static_cast<size_t>(id) >= raw_logits.size()) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias token id ", id, " is outside the vocabulary of ",
                                                     raw_logits.size()));
    }
  }
  const std::span<const float> logits = Adjust(raw_logits);
  const size_t V = logits.size();
  const bool greedy = config_.temperature == 0;
  const double inv_t = greedy ? 1.0 : 1.0 / config_.temperature;
  double max_logit = -std::numeric_limits<double>::infinity();
  for (float l : logits) {
    if (std::isfinite(l)) max_logit = std::max(max_logit, static_cast<double>(l));
  }
  if (!std::isfinite(max_logit)) return absl::InvalidArgumentError("logits have no finite value");
  // probs_: the unnormalised sampling weights exp((l - max) / T), in double. The reported
  // log-probabilities are at temperature 1 (SampledToken): log_sum1 normalises them.
  probs_.assign(V, 0.0);
  double sum = 0;
  double sum1 = 0;
  for (size_t i = 0; i < V; ++i) {
    if (!std::isfinite(logits[i])) continue;
    const double shifted = static_cast<double>(logits[i]) - max_logit;
    probs_[i] = std::exp(shifted * inv_t);
    sum += probs_[i];
    sum1 += inv_t == 1.0 ? probs_[i] : std::exp(shifted);
  }
  const double log_sum1 = max_logit + std::log(sum1);
  auto logprob = [&](size_t i) {
    return std::isfinite(logits[i]) ? static_cast<float>(static_cast<double>(logits[i]) - log_sum1)
                                    : -std::numeric_limits<float>::infinity();
  };

  // Candidates by descending probability (ties: lower id), sorted only as far as a step needs
  // (partial selection, not a sort of the vocabulary): order_[0, sorted) holds the `sorted`
  // most likely ids in order, and every id after them is less likely than order_[sorted - 1].
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  size_t sorted = 0;
  // By logit rather than by probs_: the same order wherever probs_ differ, and a strict one
  // where a low temperature underflows them to 0 (top_logprobs are reported at temperature 1).
  auto key = [&](int32_t i) {
    const float l = logits[static_cast<size_t>(i)];
    return std::isfinite(l) ? l : -std::numeric_limits<float>::infinity();
  };
  auto by_prob = [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); };
  auto sort_prefix = [&](size_t n) {
    n = std::min(n, V);
    if (n <= sorted) return;
    std::partial_sort(order_.begin() + static_cast<std::ptrdiff_t>(sorted), order_.begin() + static_cast<std::ptrdiff_t>(n),
                      order_.end(), by_prob);
    sorted = n;
  };
  // Draws from the n most likely ids with weights probs_, walking them most likely first (the
  // inverse CDF in sorted order): a small change of the logits, such as an expert moving
  // between 2 and 4 bits, then rarely changes the token a seed picks. The order is sorted only
  // as far as the walk goes, in growing steps; most of the mass sits in a few ids.
  constexpr size_t kFirstStep = 64;
  auto draw = [&](size_t n, double kept) {
    std::uniform_real_distribution<double> uniform(0.0, kept);
    const double u = uniform(rng_);
    double acc = 0;
    size_t step = kFirstStep;
    for (size_t i = 0; i < n; ++i) {
      if (i == sorted) {
        sort_prefix(std::min(n, std::max(step, sorted + 1)));
        step *= 4;
      }
      acc += probs_[order_[i]];
      if (u < acc) return order_[i];
    }
    sort_prefix(n);  // rounding left u at the very top: the least likely candidate
    return order_[n - 1];
  };

  SampledToken out;
  if (greedy) {
    sort_prefix(1);
    out.id = order_[0];
  } else if (config_.top_k == 0 && config_.top_p >= 1) {
    out.id = draw(V, sum);  // the whole distribution
  } else {
    size_t n = config_.top_k > 0 ? std::min<size_t>(config_.top_k, V) : V;
    if (config_.top_p < 1) {
      // Nucleus: the smallest prefix (of the top-k) whose mass reaches top_p, at least one
      // token. The prefix is sorted in growing steps; most of the mass sits in a few ids.
      const size_t limit = n;
      double mass = 0;
      size_t i = 0;
      bool reached = false;
      for (size_t step = kFirstStep; !reached && i < limit; step *= 4) {
        sort_prefix(std::min(limit, step));
        for (; i < sorted && i < limit; ++i) {
          mass += probs_[order_[i]] / sum;
          if (mass >= config_.top_p) {
            n = i + 1;
            reached = true;
            break;
          }
        }
      }
    }
    sort_prefix(n);
    double kept = 0;
    for (size_t i = 0; i < n; ++i) kept += probs_[order_[i]];
    out.id = draw(n, kept);
  }
  Count(out.id);
  out.logprob = logprob(static_cast<size_t>(out.id));
  sort_prefix(static_cast<size_t>(config_.top_logprobs));
  for (int i = 0; i < config_.top_logprobs && i < static_cast<int>(V); ++i) {
    out.top.emplace_back(order_[i], logprob(static_cast<size_t>(order_[i])));
  }
  return out;
}

}  // namespace nq::worker
