#include "services/eval/nvfp4_kld.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/eval/kld_run.h"
#include "services/model/model.h"
#include "services/nvfp4/served_experts.h"
#include "services/release/release_experts.h"

namespace nq::eval {

absl::StatusOr<Nvfp4KldReport> EvaluateNvfp4Kld(const Nvfp4KldRequest& request) {
  if (request.teacher_dir.empty()) return absl::InvalidArgumentError("--teacher HF_DIR is required");
  if (request.nvfp4_dir.empty()) return absl::InvalidArgumentError("--nvfp4 NVFP4_DIR is required");
  if (request.window < 2) return absl::InvalidArgumentError(absl::StrCat("--window ", request.window, ": want >= 2"));
  if (request.domains.empty()) return absl::InvalidArgumentError("no tokens to evaluate");
  ASSIGN_OR_RETURN(const model::ModelConfig student_config, model::LoadModelConfig(request.nvfp4_dir));
  ASSIGN_OR_RETURN(const bool is_nvfp4, nvfp4::IsNvfp4Checkpoint(request.nvfp4_dir, student_config));
  if (!is_nvfp4) {
    return absl::FailedPreconditionError(absl::StrCat(
        request.nvfp4_dir, " is not an NVFP4 checkpoint (no modelopt quantization_config, no hf_quant_config.json)"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  const model::ModelOptions options{.max_tokens = LongestWindow(request.domains, request.window)};
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> teacher,
                   model::Model::Load(request.teacher_dir, *backend, nullptr, options));
  RETURN_IF_ERROR(CheckTokenIds(request.domains, teacher->config().vocab_size));
  ASSIGN_OR_RETURN(release::ServedModel student,
                   release::LoadServedModel(request.nvfp4_dir, "", release::ExpertBits::k2Bit, *backend, nullptr,
                                            options, {.gate_up = request.gate_up}));
  ModelLogitSource teacher_source(*teacher), student_source(*student.model);
  Nvfp4KldReport report;
  report.teacher_dir = request.teacher_dir;
  report.nvfp4_dir = request.nvfp4_dir;
  report.gate_up = request.gate_up;
  report.window = request.window;
  report.expert_bytes = student.model->RoutedExpertBytes();
  ASSIGN_OR_RETURN(report.kl, MeasureKld(teacher_source, student_source, request.domains, request.window));
  return report;
}

nlohmann::ordered_json Nvfp4KldReportJson(const Nvfp4KldReport& r) {
  nlohmann::ordered_json json = {{"teacher", r.teacher_dir},
                                 {"nvfp4", r.nvfp4_dir},
                                 {"gate_up_scale", std::string(nvfp4::GateUpScaleModeName(r.gate_up))},
                                 {"window", r.window},
                                 {"expert_bytes", r.expert_bytes}};
  json.update(SummaryJson(r.kl.overall));
  nlohmann::ordered_json domains = nlohmann::ordered_json::object();
  for (const KldDomainReport& d : r.kl.domains) domains[d.name] = SummaryJson(d.kl);
  json["domains"] = std::move(domains);
  return json;
}

std::string Nvfp4KldReportTable(const Nvfp4KldReport& r) {
  std::string out = absl::StrFormat("nq kld: NVFP4 experts of %s (gate/up %s) against %s, window %d, %d tokens\n",
                                    r.nvfp4_dir, nvfp4::GateUpScaleModeName(r.gate_up), r.teacher_dir, r.window,
                                    r.kl.overall.tokens);
  out += "| domain | tokens | mean KL | median KL | p99 KL | top-1 |\n| --- | ---: | ---: | ---: | ---: | ---: |\n";
  for (const KldDomainReport& d : r.kl.domains) out += SummaryRow(d.name, d.kl);
  if (r.kl.domains.size() != 1) out += SummaryRow("all", r.kl.overall);
  absl::StrAppendFormat(&out, "routed experts as served: %.2f MiB\n", static_cast<double>(r.expert_bytes) / (1 << 20));
  return out;
}

}  // namespace nq::eval
