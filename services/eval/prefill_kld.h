// nq kld --prefill_tokens (issue #23): what the precision of a long prompt's prefill costs the
// tokens that follow it. Each window's first prefill_tokens tokens are a prompt the student
// prefills under one policy; the rest of the window is then teacher-forced in 16-token blocks
// with the manifest's fixed set at 4 bits and every other expert at 2 (what a worker decodes
// with before the predictor has moved anything), the same for every policy. Scored positions:
// the prompt's last (the first generated token's distribution) and every continuation
// position, whose attention reads the prefill's KV cache.
//
//   2-bit              the prompt token-order, every routed expert at 2 bits;
//   layer-major-4-bit  Model::PrefillLayerMajor with the prefill's own 4-bit experts
//                      (release::PrefillExperts: the span's most-routed experts of each layer,
//                      all of them for spans of full_span_tokens and more);
//   all-4-bit          the prompt token-order, every routed expert at 4 bits.
//
// Also reported: the share of the prefill's expert calls at 4 bits and the prefill's tokens/s
// (CPU: what the layer-major policy's reads and uploads cost against the 2-bit prefill).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "services/eval/kld_harness.h"

namespace nq::eval {

enum class PrefillPolicy { k2Bit, kLayerMajor4Bit, kAll4Bit };

// "2-bit", "layer-major-4-bit" or "all-4-bit".
absl::StatusOr<PrefillPolicy> ParsePrefillPolicy(const std::string& text);
const char* PrefillPolicyName(PrefillPolicy policy);

struct PrefillKldRequest {
  std::string teacher_dir;  // HF checkpoint: the teacher, and the student's non-expert weights
  std::string release_dir;  // NestQuant release encoded from it (TP 1)
  PrefillPolicy policy = PrefillPolicy::kLayerMajor4Bit;
  int64_t window = 2048;          // tokens per window; a window shorter than prefill_tokens + 1 is skipped
  int64_t prefill_tokens = 1536;  // the prompt: each window's first tokens
  int64_t chunk_tokens = 2048;    // prefill chunk (token order and layer-major)
  int64_t full_span_tokens = 32768;  // PrefillExpertsOptions::full_span_tokens
  std::vector<KldDomain> domains;
};

struct PrefillKldReport {
  PrefillKldRequest request;  // domains left out
  KldReport kl;
  int64_t windows = 0;
  double prefill_calls_4bit = 0;  // routed (token, layer, expert) calls of the prefills
  double prefill_calls = 0;
  double prefill_seconds = 0;
  int64_t prefill_tokens = 0;
  double PrefillShare4Bit() const { return prefill_calls > 0 ? prefill_calls_4bit / prefill_calls : 0; }
  double PrefillTokensPerSecond() const { return prefill_seconds > 0 ? prefill_tokens / prefill_seconds : 0; }
};

// INVALID_ARGUMENT for a missing directory, prefill_tokens < 1, window <= prefill_tokens,
// chunk_tokens or full_span_tokens < 1, no window long enough, or token ids outside the
// vocabulary; the model's and the release's load errors otherwise.
absl::StatusOr<PrefillKldReport> EvaluatePrefillKld(const PrefillKldRequest& request);

nlohmann::ordered_json PrefillKldReportJson(const PrefillKldReport& report);
std::string PrefillKldReportTable(const PrefillKldReport& report);

}  // namespace nq::eval
