#include "services/worker/sampler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <functional>
#include <numeric>
#include <random>
#include <span>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/worker/vector_exp.h"

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

bool Sampler::AdjustsLogits() const {
  const bool penalised = !counts_.empty() && (config_.presence_penalty != 0 || config_.frequency_penalty != 0);
  return !config_.logit_bias.empty() || penalised;
}

std::unordered_map<int32_t, float> Sampler::LogitAdjustments() const {
  std::unordered_map<int32_t, float> delta;
  for (const auto& [id, bias] : config_.logit_bias) delta[id] += bias;
  if (config_.presence_penalty != 0 || config_.frequency_penalty != 0) {
    for (const auto& [id, count] : counts_) {
      delta[id] -= config_.frequency_penalty * static_cast<float>(count) + config_.presence_penalty;
    }
  }
  return delta;
}

std::span<const float> Sampler::Adjust(std::span<const float> logits) {
  if (!AdjustsLogits()) return logits;
  adjusted_.assign(logits.begin(), logits.end());
  for (const auto& [id, delta] : LogitAdjustments()) adjusted_[static_cast<size_t>(id)] += delta;
  return adjusted_;
}

void Sampler::Count(int32_t id) { ++counts_[id]; }

uint64_t PositionSeed(uint64_t seed, uint64_t position) {
  // SplitMix64's finaliser (Steele et al. 2014), over the seed mixed with the position.
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  return mix(seed ^ mix(position));
}

void Sampler::KeyDraws() {
  if (config_.position_keyed_draws) rng_.seed(PositionSeed(config_.seed, committed_));
}

double Sampler::Key(int32_t id) const {
  const float l = logits_[static_cast<size_t>(id)];
  return std::isfinite(l) ? l : -std::numeric_limits<double>::infinity();
}

namespace {

// The largest finite value (-inf if none). Eight running maxima, so the comparisons do not wait on
// each other one by one over a 155k-id row; a maximum is exact in any order.
double MaxFinite(std::span<const float> values) {
  constexpr int kLanes = 8;
  std::array<float, kLanes> best;
  best.fill(-std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + kLanes <= values.size(); i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float v = values[i + static_cast<size_t>(k)];
      if (v > best[static_cast<size_t>(k)] && std::isfinite(v)) best[static_cast<size_t>(k)] = v;
    }
  }
  for (; i < values.size(); ++i) {
    if (values[i] > best[0] && std::isfinite(values[i])) best[0] = values[i];
  }
  return static_cast<double>(*std::max_element(best.begin(), best.end()));
}

// The sum in four running partial sums (ids i % 4), added pairwise at the end: the same value on
// every call and every machine, without one long chain of dependent additions.
double Sum(std::span<const double> values) {
  std::array<double, 4> partial{};
  size_t i = 0;
  for (; i + 4 <= values.size(); i += 4) {
    for (size_t k = 0; k < 4; ++k) partial[k] += values[i + k];
  }
  for (; i < values.size(); ++i) partial[0] += values[i];
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

// weights[i] = exp((logits[i] - max) * scale), 0 for a logit that is not finite; returns their sum.
// The exponentials go through ExpInPlace, four at a time where the CPU can.
double Weights(std::span<const float> logits, double max, double scale, std::vector<double>& weights) {
  weights.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    weights[i] = std::isfinite(l) ? (static_cast<double>(l) - max) * scale : -std::numeric_limits<double>::infinity();
  }
  ExpInPlace(weights);
  return Sum(weights);
}

// An id's place in the order SortPrefix sorts by as one integer: descending keys are descending
// logits (every non-finite one last, as -inf), ties the lower id first; -0 ranks as +0, the
// logit it equals. The same order as Key with the lower id breaking ties.
uint64_t RankKey(float logit, int32_t id) {
  const uint32_t key = kernels::SampleKey(logit == 0.0f ? 0.0f : logit);
  return (uint64_t{key} << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}

int32_t IdOfRankKey(uint64_t key) { return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key)); }

}  // namespace

void Sampler::SortPrefix(size_t n) {
  n = std::min(n, order_.size());
  if (n <= sorted_) return;
  if (ranked_from_ == kNotRanked && n <= kFirstSortStep) {
    // By logit rather than by probs_: the same order wherever probs_ differ, and a strict one
    // where a low temperature underflows them to 0 (top_logprobs are reported at temperature 1).
    auto by_prob = [&](int32_t a, int32_t b) { return Key(a) > Key(b) || (Key(a) == Key(b) && a < b); };
    std::partial_sort(order_.begin() + static_cast<std::ptrdiff_t>(sorted_),
                      order_.begin() + static_cast<std::ptrdiff_t>(n), order_.end(), by_prob);
    sorted_ = n;
    return;
  }
  // Past the first prefix (a draw walking a flat distribution, a nucleus): the unsorted ids as
  // 8-byte rank keys, sorted in place, where the comparator above reads two logits through their
  // ids per comparison (a top_p draw at 129280 ids: 5.0 -> 3.9 ms, sampler_bench). Built only
  // here, so greedy picks and short walks do not pay for them.
  if (ranked_from_ == kNotRanked) {
    ranked_from_ = sorted_;
    ranked_.resize(order_.size() - sorted_);
    for (size_t i = sorted_; i < order_.size(); ++i) {
      ranked_[i - sorted_] = RankKey(logits_[static_cast<size_t>(order_[i])], order_[i]);
    }
  }
  // The next n - sorted_ keys by selection, then a sort of those alone: a partial_sort's heap
  // costs a logarithm of the prefix per key of the rest, and a nucleus or a flat draw asks for
  // thousands (keys are unique, so the order is the same).
  const auto first = ranked_.begin() + static_cast<std::ptrdiff_t>(sorted_ - ranked_from_);
  const auto middle = ranked_.begin() + static_cast<std::ptrdiff_t>(n - ranked_from_);
  if (middle != ranked_.end()) std::nth_element(first, middle, ranked_.end(), std::greater<>());
  std::sort(first, middle, std::greater<>());
  for (size_t i = sorted_; i < n; ++i) order_[i] = IdOfRankKey(ranked_[i - ranked_from_]);
  sorted_ = n;
}

absl::Status Sampler::Prepare(std::span<const float> raw_logits) {
  for (const auto& [id, bias] : config_.logit_bias) {
    if (static_cast<size_t>(id) >= raw_logits.size()) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias token id ", id, " is outside the vocabulary of ",
                                                     raw_logits.size()));
    }
  }
  logits_ = Adjust(raw_logits);
  if (argmax_only()) {
    // SortPrefix(1)'s pick (the largest finite logit, ties: the lower id) in one pass, and nothing
    // of the distribution: no log-probability is reported.
    float best = -std::numeric_limits<float>::infinity();
    int64_t at = -1;
    for (size_t i = 0; i < logits_.size(); ++i) {
      const float l = logits_[i];
      if (l > best && std::isfinite(l)) {
        best = l;
        at = static_cast<int64_t>(i);
      }
    }
    if (at < 0) return absl::InvalidArgumentError("logits have no finite value");
    argmax_ = static_cast<int32_t>(at);
    return absl::OkStatus();
  }
  const size_t V = logits_.size();
  const bool greedy = config_.temperature == 0;
  const double inv_t = greedy ? 1.0 : 1.0 / config_.temperature;
  const double max_logit = MaxFinite(logits_);
  if (!std::isfinite(max_logit)) return absl::InvalidArgumentError("logits have no finite value");
  // probs_: the unnormalised sampling weights exp((l - max) / T), in double. The reported
  // log-probabilities are at temperature 1 (SampledToken): log_sum1_ normalises them.
  sum_ = Weights(logits_, max_logit, inv_t, probs_);
  const bool own_sum1 = inv_t != 1.0 && reports_logprobs();  // else sum_ is it, or it is unused
  const double sum1 = own_sum1 ? Weights(logits_, max_logit, 1.0, unscaled_) : sum_;
  log_sum1_ = max_logit + std::log(sum1);

  // Candidates by descending probability (ties: lower id), sorted only as far as a step needs
  // (partial selection, not a sort of the vocabulary): order_[0, sorted_) holds the sorted_
  // most likely ids in order, and every id after them is less likely than order_[sorted_ - 1].
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  sorted_ = 0;
  ranked_from_ = kNotRanked;
  if (greedy) {
    kept_ = 1;
  } else if (config_.top_k == 0 && config_.top_p >= 1) {
    kept_ = V;  // the whole distribution
  } else {
    kept_ = config_.top_k > 0 ? std::min<size_t>(config_.top_k, V) : V;
    if (config_.top_p < 1) {
      // Nucleus: the smallest prefix (of the top-k) whose mass reaches top_p, at least one
      // token. The prefix is sorted in growing steps; most of the mass sits in a few ids.
      const size_t limit = kept_;
      double mass = 0;
      size_t i = 0;
      bool reached = false;
      for (size_t step = kFirstSortStep; !reached && i < limit; step *= 4) {
        SortPrefix(std::min(limit, step));
        for (; i < sorted_ && i < limit; ++i) {
          mass += probs_[order_[i]] / sum_;
          if (mass >= config_.top_p) {
            kept_ = i + 1;
            reached = true;
            break;
          }
        }
      }
    }
  }
  if (!greedy && config_.top_k == 0 && config_.top_p >= 1) {
    kept_mass_ = sum_;
  } else {
    SortPrefix(kept_);
    kept_mass_ = 0;
    for (size_t i = 0; i < kept_; ++i) kept_mass_ += probs_[order_[i]];
  }
  return absl::OkStatus();
}

int32_t Sampler::Draw() {
  if (config_.temperature == 0) {
    if (argmax_only()) return argmax_;
    SortPrefix(1);
    return order_[0];
  }
  // Draws from the kept_ most likely ids with weights probs_, walking them most likely first
  // (the inverse CDF in sorted order): a small change of the logits, such as an expert moving
  // between 2 and 4 bits, then rarely changes the token a seed picks. The order is sorted only
  // as far as the walk goes, in growing steps; most of the mass sits in a few ids.
  std::uniform_real_distribution<double> uniform(0.0, kept_mass_);
  const double u = uniform(rng_);
  double acc = 0;
  size_t step = kFirstSortStep;
  for (size_t i = 0; i < kept_; ++i) {
    if (i == sorted_) {
      SortPrefix(std::min(kept_, std::max(step, sorted_ + 1)));
      step *= 4;
    }
    acc += probs_[order_[i]];
    if (u < acc) return order_[i];
  }
  SortPrefix(kept_);  // rounding left u at the very top: the least likely candidate
  return order_[kept_ - 1];
}

SampledToken Sampler::Commit(int32_t id) {
  auto logprob = [&](size_t i) {
    return std::isfinite(logits_[i]) ? static_cast<float>(static_cast<double>(logits_[i]) - log_sum1_)
                                     : -std::numeric_limits<float>::infinity();
  };
  SampledToken out;
  out.id = id;
  Count(id);
  ++committed_;
  if (!reports_logprobs()) return out;  // none were asked for (or prepared)
  out.logprob = logprob(static_cast<size_t>(id));
  SortPrefix(static_cast<size_t>(config_.top_logprobs));
  for (int i = 0; i < config_.top_logprobs && i < static_cast<int>(order_.size()); ++i) {
    out.top.emplace_back(order_[i], logprob(static_cast<size_t>(order_[i])));
  }
  return out;
}

void Sampler::MarkKept() {
  // The whole vocabulary is kept unless top-k / top-p cut it (then order_[0, kept_) is sorted).
  in_kept_.assign(order_.size(), kept_ == order_.size() ? 1 : 0);
  if (kept_ < order_.size()) {
    for (size_t i = 0; i < kept_; ++i) in_kept_[static_cast<size_t>(order_[i])] = 1;
  }
}

double Sampler::TargetProbability(int32_t id) const {
  return in_kept_[static_cast<size_t>(id)] != 0 ? probs_[static_cast<size_t>(id)] / kept_mass_ : 0.0;
}

bool Sampler::DrawsOnDevice() const {
  return !reports_logprobs() && config_.logit_bias.empty() && config_.presence_penalty == 0 &&
         config_.frequency_penalty == 0;
}

bool Sampler::DrawsOnDeviceAdjusted(size_t vocab) const {
  if (reports_logprobs()) return false;
  return std::all_of(config_.logit_bias.begin(), config_.logit_bias.end(),
                     [&](const std::pair<int32_t, float>& entry) { return static_cast<size_t>(entry.first) < vocab; });
}

std::optional<kernels::SampleParams> Sampler::DeviceDrawAdjusted(size_t vocab, std::vector<float>& logit_delta) {
  logit_delta.clear();
  if (!DrawsOnDeviceAdjusted(vocab)) return std::nullopt;
  if (AdjustsLogits()) {
    logit_delta.assign(vocab, 0.0f);
    for (const auto& [id, delta] : LogitAdjustments()) logit_delta[static_cast<size_t>(id)] = delta;
  }
  return NextDeviceDraw();
}

std::optional<kernels::SampleParams> Sampler::DeviceDraw() {
  if (!DrawsOnDevice()) return std::nullopt;
  return NextDeviceDraw();
}

kernels::SampleParams Sampler::NextDeviceDraw() {
  kernels::SampleParams p{.temperature = config_.temperature, .top_p = config_.top_p, .top_k = config_.top_k};
  KeyDraws();
  // Draw()'s uniform_real_distribution(0, kept mass) is kept mass times this canonical value.
  if (config_.temperature != 0) p.u01 = std::generate_canonical<double, std::numeric_limits<double>::digits>(rng_);
  return p;
}

std::optional<std::vector<kernels::SampleParams>> Sampler::DeviceDraws(size_t rows) {
  if (rows == 0 || (rows > 1 && !config_.position_keyed_draws)) return std::nullopt;
  const std::optional<kernels::SampleParams> first = DeviceDraw();
  if (!first.has_value()) return std::nullopt;
  std::vector<kernels::SampleParams> draws(rows, *first);
  for (size_t k = 1; k < rows && config_.temperature != 0; ++k) {
    rng_.seed(PositionSeed(config_.seed, committed_ + k));
    draws[k].u01 = std::generate_canonical<double, std::numeric_limits<double>::digits>(rng_);
  }
  return draws;
}

SampledToken Sampler::CommitSampled(int32_t id) {
  Count(id);
  ++committed_;
  return SampledToken{.id = id};
}

absl::StatusOr<SampledToken> Sampler::Sample(std::span<const float> logits) {
  RETURN_IF_ERROR(Prepare(logits));
  KeyDraws();
  return Commit(Draw());
}

absl::StatusOr<std::vector<float>> Sampler::Distribution(std::span<const float> logits) {
  RETURN_IF_ERROR(Prepare(logits));
  std::vector<float> p(logits.size(), 0.0f);
  if (config_.temperature == 0) {
    p[static_cast<size_t>(Draw())] = 1.0f;
    return p;
  }
  MarkKept();
  for (size_t id = 0; id < p.size(); ++id) p[id] = static_cast<float>(TargetProbability(static_cast<int32_t>(id)));
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
  KeyDraws();
  if (config_.temperature == 0 || draft_probs.empty()) {
    // Greedy: exactly plain decoding's pick, so the output is identical token for token. A
    // deterministic draft: the row's own draw, kept when it is the draft (Verify's contract).
    const int32_t id = Draw();
    return Verdict{.accepted = id == draft, .token = Commit(id)};
  }
  MarkKept();
  auto q = [&](size_t id) -> double { return draft_probs[id]; };
  const double q_draft = q(static_cast<size_t>(draft));
  if (!(q_draft > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("draft token ", draft, " has no mass in its draft distribution"));
  }
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  if (uniform(rng_) * q_draft < TargetProbability(draft)) {
    return Verdict{.accepted = true, .token = Commit(draft)};
  }
  // Rejected: draw from the residual max(0, p - q), over the ids in order (the residual's
  // order does not matter to its distribution, and needs no sort of the vocabulary).
  const size_t V = logits.size();
  double residual_mass = 0;
  for (size_t id = 0; id < V; ++id) residual_mass += std::max(0.0, TargetProbability(static_cast<int32_t>(id)) - q(id));
  if (!(residual_mass > 0)) {
    // p <= q everywhere means p == q, where a rejection has probability 0; rounding can still
    // land here: p itself is then the right distribution.
    return Verdict{.accepted = false, .token = Commit(Draw())};
  }
  std::uniform_real_distribution<double> residual_uniform(0.0, residual_mass);
  const double u = residual_uniform(rng_);
  double acc = 0;
  int32_t id = -1;
  for (size_t i = 0; i < V; ++i) {
    const double r = std::max(0.0, TargetProbability(static_cast<int32_t>(i)) - q(i));
    if (r <= 0) continue;
    id = static_cast<int32_t>(i);  // rounding past the end lands on the last token with residual mass
    acc += r;
    if (u < acc) break;
  }
  return Verdict{.accepted = false, .token = Commit(id)};
}

}  // namespace nq::worker
