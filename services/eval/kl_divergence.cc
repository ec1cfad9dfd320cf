#include "services/eval/kl_divergence.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::eval {
namespace {

// The value at quantile q of `sorted` (ascending, non-empty), linear between neighbours.
double Quantile(const std::vector<double>& sorted, double q) {
  const double position = q * static_cast<double>(sorted.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return sorted[below] + fraction * (sorted[above] - sorted[below]);
}

}  // namespace

absl::Status LogSoftmax(std::span<const float> logits, std::span<double> out) {
  if (logits.empty()) return absl::InvalidArgumentError("LogSoftmax: no logits");
  if (out.size() != logits.size()) {
    return absl::InvalidArgumentError(absl::StrCat("LogSoftmax: ", logits.size(), " logits but room for ", out.size()));
  }
  double max = -INFINITY;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      return absl::InvalidArgumentError(absl::StrCat("LogSoftmax: logit ", i, " is ", logits[i]));
    }
    max = std::max(max, static_cast<double>(logits[i]));
  }
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max);
  const double log_normaliser = max + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - log_normaliser;
  return absl::OkStatus();
}

absl::StatusOr<TokenKl> KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  if (p_logits.size() != q_logits.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KL: distributions over ", p_logits.size(), " and ", q_logits.size(), " tokens"));
  }
  std::vector<double> log_p(p_logits.size()), log_q(q_logits.size());
  RETURN_IF_ERROR(LogSoftmax(p_logits, log_p));
  RETURN_IF_ERROR(LogSoftmax(q_logits, log_q));
  double kl = 0;
  for (size_t i = 0; i < log_p.size(); ++i) kl += std::exp(log_p[i]) * (log_p[i] - log_q[i]);
  const auto argmax_p = std::max_element(p_logits.begin(), p_logits.end()) - p_logits.begin();
  const auto argmax_q = std::max_element(q_logits.begin(), q_logits.end()) - q_logits.begin();
  return TokenKl{.kl = std::max(kl, 0.0), .top1_agrees = argmax_p == argmax_q};
}

absl::StatusOr<std::vector<TokenKl>> KlDivergenceRows(std::span<const float> p_logits, std::span<const float> q_logits,
                                                      int64_t vocab) {
  if (vocab <= 0 || p_logits.size() != q_logits.size() || p_logits.size() % static_cast<size_t>(vocab) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("KL: logits of ", p_logits.size(), " and ", q_logits.size(),
                                                   " values are not two [rows, ", vocab, "] arrays"));
  }
  const size_t v = static_cast<size_t>(vocab), rows = p_logits.size() / v;
  std::vector<TokenKl> out;
  out.reserve(rows);
  for (size_t r = 0; r < rows; ++r) {
    absl::StatusOr<TokenKl> row = KlDivergence(p_logits.subspan(r * v, v), q_logits.subspan(r * v, v));
    if (!row.ok()) return Annotate(row.status(), absl::StrCat("row ", r));
    out.push_back(*row);
  }
  return out;
}

KlSummary SummarizeKl(std::span<const TokenKl> tokens) {
  KlSummary summary;
  if (tokens.empty()) return summary;
  std::vector<double> sorted;
  sorted.reserve(tokens.size());
  double total = 0, agree = 0;
  for (const TokenKl& t : tokens) {
    sorted.push_back(t.kl);
    total += t.kl;
    agree += t.top1_agrees ? 1 : 0;
  }
  std::sort(sorted.begin(), sorted.end());
  const double n = static_cast<double>(tokens.size());
  summary.tokens = static_cast<int64_t>(tokens.size());
  summary.mean = total / n;
  summary.median = Quantile(sorted, 0.5);
  summary.p99 = Quantile(sorted, 0.99);
  summary.top1_agreement = agree / n;
  return summary;
}

}  // namespace nq::eval
