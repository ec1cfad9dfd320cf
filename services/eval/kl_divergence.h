// Full-vocabulary KL divergence between two next-token distributions given as float32 logits
// (what our engine produces), computed in float64: the measure of what quantized experts cost
// (issue #7, nq kld; MeasureReleaseKl). Natural logarithms, so KL is in nats.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::eval {

// out[i] = logits[i] - log(sum_j exp(logits[j])), in float64 (max-shifted, so any finite
// logits work). `out` must be as long as `logits`. INVALID_ARGUMENT for empty logits, a
// length mismatch, or a logit that is not finite.
absl::Status LogSoftmax(std::span<const float> logits, std::span<double> out);

struct TokenKl {
  double kl = 0;             // KL(p || q) = sum_i p_i (log p_i - log q_i), >= 0
  bool top1_agrees = false;  // argmax p == argmax q (the first index on ties)
};

// KL(softmax(p_logits) || softmax(q_logits)) over one vocabulary: p is the reference
// (teacher), q the approximation (student). For nearly equal distributions float64 rounding
// can leave a sum of about -1e-17; it is reported as 0.
absl::StatusOr<TokenKl> KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits);

// Row by row over two [rows, vocab] row-major logit arrays of the same shape.
absl::StatusOr<std::vector<TokenKl>> KlDivergenceRows(std::span<const float> p_logits, std::span<const float> q_logits,
                                                      int64_t vocab);

struct KlSummary {
  int64_t tokens = 0;
  double mean = 0;
  double median = 0;
  double p99 = 0;
  double top1_agreement = 0;  // share of tokens whose argmax agrees
};

// Quantiles interpolate linearly between order statistics (numpy's default), so the median
// of an even count is the mean of the middle two. All zeros for no tokens.
KlSummary SummarizeKl(std::span<const TokenKl> tokens);

}  // namespace nq::eval
