// nq kld end to end (issue #7): the full-precision teacher against the release-served student
// in one mode, with the KL report, the 4-bit share of expert calls and routing weight, and
// the routed experts' bits per weight; as a table for people and JSON for the bench.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/eval/kld_harness.h"
#include "services/eval/kld_student.h"

namespace nq::eval {

struct KldRequest {
  std::string teacher_dir;  // HF checkpoint: the teacher, and the student's non-expert weights
  std::string release_dir;  // NestQuant release encoded from it (TP 1)
  KldMode mode = KldMode::kAll4Bit;
  int64_t window = 2048;  // tokens per window; each window starts a fresh KV cache
  int slots = 8;          // F: floating 4-bit experts per MoE layer (oracle, previous-block, live)
  std::vector<KldDomain> domains;
  std::string streamer_address;  // live: host:port of the nq-streamer serving the release
};

struct KldRunReport {
  std::string teacher_dir;
  std::string release_dir;
  KldMode mode = KldMode::kAll4Bit;
  int64_t window = 0;
  int slots = 0;
  KldReport kl;
  ExpertUsage usage;
  ExpertBytes bytes;
};

// INVALID_ARGUMENT for a missing directory argument, window < 2, negative slots, or no
// tokens.
absl::Status ValidateKldRequest(const KldRequest& request);

// Validates, then runs the mode (live: LiveStudentSource, kld_live.h). INVALID_ARGUMENT for token ids outside
// the teacher's vocabulary; the model's and the release's load errors otherwise.
absl::StatusOr<KldRunReport> EvaluateKld(const KldRequest& request);

nlohmann::ordered_json KldReportJson(const KldRunReport& report);
// One KL summary as JSON (tokens, mean_kl, median_kl, p99_kl, top1_agreement) and as a row of
// the report tables.
nlohmann::ordered_json SummaryJson(const KlSummary& s);
std::string SummaryRow(const std::string& name, const KlSummary& s);
// A Markdown table of the domains and the total, then the 4-bit share and bits per weight.
std::string KldReportTable(const KldRunReport& report);

}  // namespace nq::eval
