#include "services/eval/kld_run.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"
#include "services/eval/kld_live.h"

namespace nq::eval {

nlohmann::ordered_json SummaryJson(const KlSummary& s) {
  return {{"tokens", s.tokens},
          {"mean_kl", s.mean},
          {"median_kl", s.median},
          {"p99_kl", s.p99},
          {"top1_agreement", s.top1_agreement}};
}

std::string SummaryRow(const std::string& name, const KlSummary& s) {
  return absl::StrFormat("| %s | %d | %.6f | %.6f | %.6f | %.4f |\n", name, s.tokens, s.mean, s.median, s.p99,
                         s.top1_agreement);
}

absl::Status ValidateKldRequest(const KldRequest& request) {
  if (request.teacher_dir.empty()) return absl::InvalidArgumentError("--teacher HF_DIR is required");
  if (request.release_dir.empty()) return absl::InvalidArgumentError("--release RELEASE is required");
  if (request.window < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--window ", request.window, ": a window needs at least 2 tokens"));
  }
  if (request.slots < 0) return absl::InvalidArgumentError(absl::StrCat("--slots ", request.slots, ": want >= 0"));
  if (request.domains.empty()) return absl::InvalidArgumentError("no tokens to evaluate");
  return absl::OkStatus();
}

absl::StatusOr<KldRunReport> EvaluateKld(const KldRequest& request) {
  RETURN_IF_ERROR(ValidateKldRequest(request));
  ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(request.teacher_dir));
  RETURN_IF_ERROR(CheckTokenIds(request.domains, config.vocab_size));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  const int64_t max_tokens = LongestWindow(request.domains, request.window);
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> teacher_model,
                   model::Model::Load(request.teacher_dir, *backend, nullptr, {.max_tokens = max_tokens}));
  // The student: the local policies, or live through the streamer.
  std::unique_ptr<StudentSource> student;
  if (request.mode == KldMode::kLive) {
    ASSIGN_OR_RETURN(student, LiveStudentSource::Load(request, max_tokens, *backend));
  } else {
    ASSIGN_OR_RETURN(student, StudentLogitSource::Load({.model_dir = request.teacher_dir,
                                                        .release_dir = request.release_dir,
                                                        .mode = request.mode,
                                                        .slots = request.slots,
                                                        .max_tokens = max_tokens},
                                                       *backend));
  }
  ModelLogitSource teacher(*teacher_model);
  KldRunReport report{.teacher_dir = request.teacher_dir,
                      .release_dir = request.release_dir,
                      .mode = request.mode,
                      .window = request.window,
                      .slots = request.slots};
  ASSIGN_OR_RETURN(report.kl, MeasureKld(teacher, *student, request.domains, request.window));
  report.usage = student->usage();
  report.bytes = student->bytes();
  return report;
}

nlohmann::ordered_json KldReportJson(const KldRunReport& r) {
  nlohmann::ordered_json json = {{"teacher", r.teacher_dir},        {"release", r.release_dir},
                                 {"mode", KldModeName(r.mode)},     {"window", r.window},
                                 {"block_tokens", kKldBlockTokens}, {"slots", r.slots}};
  json.update(SummaryJson(r.kl.overall));
  nlohmann::ordered_json domains = nlohmann::ordered_json::object();
  for (const KldDomainReport& d : r.kl.domains) domains[d.name] = SummaryJson(d.kl);
  json["domains"] = std::move(domains);
  json["expert_calls"] = r.usage.calls;
  json["four_bit_share"] = {
      {"calls", r.usage.CallShare()}, {"weight", r.usage.WeightShare()}, {"experts_held", r.usage.HeldShare()}};
  // Memory: the share of experts that hold their residual. By calls: bits an average
  // expert call reads.
  json["bits_per_weight"] = r.bytes.BitsPerWeight(r.usage.HeldShare());
  json["bits_per_weight_by_calls"] = r.bytes.BitsPerWeight(r.usage.CallShare());
  json["bits_per_weight_2bit"] = r.bytes.BitsPerWeight(0);
  json["bits_per_weight_4bit"] = r.bytes.BitsPerWeight(1);
  json["expert_bytes"] = {{"resident", r.bytes.resident},
                          {"resident_files", r.bytes.resident_files},
                          {"residual", r.bytes.residual},
                          {"weights", r.bytes.weights}};
  return json;
}

std::string KldReportTable(const KldRunReport& r) {
  std::string out =
      absl::StrFormat("nq kld: mode %s, %d floating slots per layer, blocks of %d, window %d, %d tokens\n",
                      KldModeName(r.mode), r.slots, kKldBlockTokens, r.window, r.kl.overall.tokens);
  out += "| domain | tokens | mean KL | median KL | p99 KL | top-1 |\n| --- | ---: | ---: | ---: | ---: | ---: |\n";
  for (const KldDomainReport& d : r.kl.domains) out += SummaryRow(d.name, d.kl);
  if (r.kl.domains.size() != 1) out += SummaryRow("all", r.kl.overall);
  absl::StrAppendFormat(&out,
                        "4-bit share: %.4f of %.0f expert calls, %.4f of routing weight; %.4f of experts held at 4 "
                        "bits\n",
                        r.usage.CallShare(), r.usage.calls, r.usage.WeightShare(), r.usage.HeldShare());
  absl::StrAppendFormat(&out, "routed experts: %.3f bits per weight (2-bit %.3f, 4-bit %.3f; by calls %.3f)\n",
                        r.bytes.BitsPerWeight(r.usage.HeldShare()), r.bytes.BitsPerWeight(0), r.bytes.BitsPerWeight(1),
                        r.bytes.BitsPerWeight(r.usage.CallShare()));
  return out;
}

}  // namespace nq::eval
