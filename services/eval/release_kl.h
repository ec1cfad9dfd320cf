// What a release costs in quality: the model served from a NestQuant release at one expert
// precision against the full-precision model, on the same tokens (nq encode --kl_tokens and
// the release tests).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "services/release/release_experts.h"

namespace nq::eval {

// Mean KL(full || quantized) over the tokens' next-token distributions (float64, nats), and
// how often the two argmaxes agree.
struct KlReport {
  double mean_kl = 0;
  double top1_agreement = 0;
};

// Encodes `model_dir` into `release_dir` (if it holds no complete release yet) and compares
// the model served from it at `bits` against the full-precision model on `tokens`.
absl::StatusOr<KlReport> MeasureReleaseKl(const std::string& model_dir, const std::string& release_dir,
                                          std::span<const int32_t> tokens, release::ExpertBits bits);

}  // namespace nq::eval
