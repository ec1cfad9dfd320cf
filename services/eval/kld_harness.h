// The teacher-forced KL harness of nq kld (issue #7): two logit sources read the same token
// windows block by block, and every position's next-token distribution is compared over the
// full vocabulary in float64 (kl_divergence.h). The sources are an interface so the harness
// can compare any two: the full-precision model against itself (KL = 0), or against the
// model served from a NestQuant release under an expert-precision policy (kld_student.h).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/eval/kl_divergence.h"
#include "services/model/model.h"

namespace nq::eval {

// Tokens per block: the slot refresh interval of DESIGN.md section 7 (the predictor's
// refresh_interval), so block-wise expert policies (oracle, previous block) see the blocks
// the streamer would. Every source runs a window in blocks of this many tokens.
inline constexpr int64_t kKldBlockTokens = 16;

// One named part of an evaluation set (e.g. "python", "prose"); each sequence is cut into
// windows on its own.
struct KldDomain {
  std::string name;
  std::vector<std::vector<int32_t>> sequences;
};

// Reads token files. A file holds one of
//   - a JSON list of ids, or a list of such lists (sequences): one domain, named by the
//     file's stem ("python" for python.json);
//   - a JSON object {"domain": ids or list of id lists, ...}: one domain per key, in file
//     order;
//   - anything else: ids one sequence per line, comma or space separated (release::ReadTokenFile),
//     one domain named by the stem.
// NOT_FOUND for a missing file; INVALID_ARGUMENT for a malformed file, a negative id, a
// domain without tokens, or a domain name given twice.
absl::StatusOr<std::vector<KldDomain>> ReadKldTokens(std::span<const std::string> paths);
// Keeps the domains named in `names` (in that order); all of them when `names` is empty.
// INVALID_ARGUMENT naming the domains there are when one is missing.
absl::StatusOr<std::vector<KldDomain>> SelectDomains(std::vector<KldDomain> domains,
                                                     std::span<const std::string> names);
// INVALID_ARGUMENT naming the domain, sequence and position of the first id >= vocab_size.
absl::Status CheckTokenIds(std::span<const KldDomain> domains, int64_t vocab_size);
// The longest sequence, at most `window`: the KV cache a source needs.
int64_t LongestWindow(std::span<const KldDomain> domains, int64_t window);

// One side of the comparison. A source sees each window from its start: BeginWindow, then
// Next over consecutive blocks of at most kKldBlockTokens tokens.
class LogitSource {
 public:
  virtual ~LogitSource() = default;
  virtual int64_t vocab_size() const = 0;
  // Starts a window with a fresh KV cache.
  virtual absl::Status BeginWindow() = 0;
  // Logits [block.size(), vocab_size] of the window's next tokens, row-major, float32.
  virtual absl::StatusOr<std::vector<float>> Next(std::span<const int32_t> block) = 0;
};

// A model as it is: the teacher (or any fixed-weight student). The model must outlive this.
class ModelLogitSource : public LogitSource {
 public:
  explicit ModelLogitSource(model::Model& model) : model_(model) {}
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  absl::Status BeginWindow() override;
  absl::StatusOr<std::vector<float>> Next(std::span<const int32_t> block) override;

 private:
  model::Model& model_;
};

struct KldDomainReport {
  std::string name;
  KlSummary kl;
};

struct KldReport {
  KlSummary overall;
  std::vector<KldDomainReport> domains;  // in the order given
};

// KL(teacher || student) at every position of every window: each sequence is cut into
// windows of `window` tokens (the last may be shorter), each window starts a fresh cache,
// and each position's next-token distribution is scored, the window's last included
// (teacher forcing needs no target token). INVALID_ARGUMENT for window < 2 or sources of
// different vocabularies.
absl::StatusOr<KldReport> MeasureKld(LogitSource& teacher, LogitSource& student, std::span<const KldDomain> domains,
                                     int64_t window);

}  // namespace nq::eval
