#include "services/worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

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

absl::Status Sampler::Prepare(std::span<const float> raw_logits) {
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
  // Softmax of the scaled logits, in double, left unnormalised (sum_ holds the total).
  double max_logit = -std::numeric_limits<double>::infinity();
  for (float l : logits) {
    if (std::isfinite(l)) max_logit = std::max(max_logit, static_cast<double>(l) * inv_t);
  }
  if (!std::isfinite(max_logit)) return absl::InvalidArgumentError("logits have no finite value");
  probs_.assign(V, 0.0);
  sum_ = 0;
  for (size_t i = 0; i < V; ++i) {
    if (!std::isfinite(logits[i])) continue;
    probs_[i] = std::exp(static_cast<double>(logits[i]) * inv_t - max_logit);
    sum_ += probs_[i];
  }

  // Candidates by descending probability (ties: lower id), truncated by top-k then top-p.
  const size_t keep_k = config_.top_k > 0 ? std::min<size_t>(config_.top_k, V) : V;
  const size_t need_sorted = std::max<size_t>(greedy ? 1 : keep_k, config_.top_logprobs);
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  auto by_prob = [&](int32_t a, int32_t b) { return probs_[a] > probs_[b] || (probs_[a] == probs_[b] && a < b); };
  if (need_sorted < V) {
    std::partial_sort(order_.begin(), order_.begin() + need_sorted, order_.end(), by_prob);
  } else {
    std::sort(order_.begin(), order_.end(), by_prob);
  }
  if (greedy) {
    kept_ = 1;
  } else {
    // Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
    kept_ = keep_k;
    if (config_.top_p < 1) {
      double mass = 0;
      for (size_t i = 0; i < keep_k; ++i) {
        mass += probs_[order_[i]] / sum_;
        if (mass >= config_.top_p) {
          kept_ = i + 1;
          break;
        }
      }
    }
  }
  kept_mass_ = 0;
  for (size_t i = 0; i < kept_; ++i) kept_mass_ += probs_[order_[i]];
  return absl::OkStatus();
}

int32_t Sampler::Draw() {
  if (config_.temperature == 0) return order_[0];
  std::uniform_real_distribution<double> uniform(0.0, kept_mass_);
  const double u = uniform(rng_);
  double acc = 0;
  for (size_t i = 0; i < kept_; ++i) {
    acc += probs_[order_[i]];
    if (u < acc) return order_[i];
  }
  return order_[kept_ - 1];
}

SampledToken Sampler::Commit(int32_t id) {
  const double log_sum = std::log(sum_);
  auto logprob = [&](size_t i) {
    return probs_[i] > 0 ? static_cast<float>(std::log(probs_[i]) - log_sum)
                         : -std::numeric_limits<float>::infinity();
  };
  SampledToken out;
  out.id = id;
  Count(id);
  out.logprob = logprob(static_cast<size_t>(id));
  for (int i = 0; i < config_.top_logprobs && i < static_cast<int>(order_.size()); ++i) {
    out.top.emplace_back(order_[i], logprob(static_cast<size_t>(order_[i])));
  }
  return out;
}

double Sampler::TargetProbability(int32_t id) const {
  return in_kept_[static_cast<size_t>(id)] != 0 ? probs_[static_cast<size_t>(id)] / kept_mass_ : 0.0;
}

absl::StatusOr<SampledToken> Sampler::Sample(std::span<const float> logits) {
  RETURN_IF_ERROR(Prepare(logits));
  return Commit(Draw());
}

absl::StatusOr<std::vector<float>> Sampler::Distribution(std::span<const float> logits) {
  RETURN_IF_ERROR(Prepare(logits));
  std::vector<float> p(logits.size(), 0.0f);
  for (size_t i = 0; i < kept_; ++i) p[order_[i]] = static_cast<float>(probs_[order_[i]] / kept_mass_);
  return p;
}

absl::StatusOr<Sampler::Verdict> Sampler::Verify(std::span<const float> logits, int32_t draft,
                                                 std::span<const float> draft_probs) {
  if (draft < 0 || static_cast<size_t>(draft) >= logits.size()) {
    return absl::InvalidArgumentError(absl::StrCat("draft token ", draft, " is outside the vocabulary of ",
                                                   logits.size()));
  }
  if (!draft_probs.empty() && draft_probs.size() != logits.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a draft distribution over ", draft_probs.size(),
                                                   " tokens for logits over ", logits.size()));
  }
  RETURN_IF_ERROR(Prepare(logits));
  if (config_.temperature == 0) {
    // Greedy: exactly plain decoding's pick, so the output is identical token for token.
    const int32_t id = Draw();
    return Verdict{.accepted = id == draft, .token = Commit(id)};
  }
  in_kept_.assign(logits.size(), 0);
  for (size_t i = 0; i < kept_; ++i) in_kept_[static_cast<size_t>(order_[i])] = 1;
  auto q = [&](size_t id) -> double {
    if (draft_probs.empty()) return id == static_cast<size_t>(draft) ? 1.0 : 0.0;
    return draft_probs[id];
  };
  const double q_draft = q(static_cast<size_t>(draft));
  if (!(q_draft > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("draft token ", draft, " has no mass in its draft distribution"));
  }
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  if (uniform(rng_) * q_draft < TargetProbability(draft)) {
    return Verdict{.accepted = true, .token = Commit(draft)};
  }
  // Rejected: draw from the residual max(0, p - q). Only kept tokens have p > 0.
  double residual_mass = 0;
  for (size_t i = 0; i < kept_; ++i) {
    residual_mass += std::max(0.0, TargetProbability(order_[i]) - q(static_cast<size_t>(order_[i])));
  }
  if (!(residual_mass > 0)) {
    // p <= q everywhere means p == q, where a rejection has probability 0; rounding can still
    // land here: p itself is then the right distribution.
    return Verdict{.accepted = false, .token = Commit(Draw())};
  }
  std::uniform_real_distribution<double> residual_uniform(0.0, residual_mass);
  const double u = residual_uniform(rng_);
  double acc = 0;
  int32_t id = -1;
  for (size_t i = 0; i < kept_; ++i) {
    const double r = std::max(0.0, TargetProbability(order_[i]) - q(static_cast<size_t>(order_[i])));
    if (r <= 0) continue;
    id = order_[i];  // rounding past the end lands on the last token with residual mass
    acc += r;
    if (u < acc) break;
  }
  return Verdict{.accepted = false, .token = Commit(id)};
}

}  // namespace nq::worker
