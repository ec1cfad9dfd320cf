// nq kld: KL(teacher || student) of the model served from a NestQuant release in one expert
// precision mode, or from an NVFP4 checkpoint (--nvfp4, issue #20); nq mtp-acceptance: the MTP
// layer's offline draft acceptance (issue #7).
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/eval/kld_run.h"
#include "services/eval/mtp_acceptance.h"
#include "services/eval/nvfp4_kld.h"
#include "services/eval/prefill_kld.h"
#include "services/format/file_io.h"
#include "services/model/model.h"
#include "services/release/release_experts.h"
#include "services/tools/commands.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, tokens);
ABSL_DECLARE_FLAG(std::string, release);
ABSL_DECLARE_FLAG(std::string, expert_bits);
ABSL_DECLARE_FLAG(int, slots);
ABSL_FLAG(std::string, teacher, "", "kld: the full-precision HF checkpoint the release was encoded from");
ABSL_FLAG(std::string, mode, "",
          "kld: all-4-bit, all-2-bit, fixed-set, oracle, previous-block or live (see nq kld's report)");
ABSL_FLAG(std::string, nvfp4, "",
          "kld: an NVFP4 checkpoint (ModelOpt layout) to score against --teacher instead of a release, its routed "
          "experts served packed as the worker serves them");
ABSL_FLAG(std::string, nvfp4_gate_up_scale, "compensate",
          "kld --nvfp4, bench-decode of an NVFP4 checkpoint: how each expert's gate and up halves share one "
          "global scale (compensate, requantize, gate_only), as nq-worker's flag");
ABSL_FLAG(std::string, streamer, "", "kld --mode live: host:port of the nq-streamer serving --release");
ABSL_FLAG(int64_t, window, 2048, "kld, mtp-acceptance: tokens per window (a fresh KV cache each)");
ABSL_FLAG(std::string, domains, "", "kld, mtp-acceptance: comma-separated domains to evaluate (default: all)");
ABSL_FLAG(int64_t, prefill_tokens, 0,
          "kld: each window's first N tokens are a prompt prefilled under --prefill_mode, the rest decoded with the "
          "fixed set (issue #23; 0: the --mode evaluation)");
ABSL_FLAG(std::string, prefill_mode, "layer-major-4-bit", "kld --prefill_tokens: 2-bit, layer-major-4-bit or all-4-bit");
ABSL_FLAG(int64_t, prefill_chunk_tokens, 2048, "kld --prefill_tokens, bench-prefill: tokens per prefill chunk");
ABSL_FLAG(int64_t, full_span_tokens, 32768,
          "kld --prefill_mode layer-major-4-bit: spans this long load every routed expert they use at 4 bits; shorter "
          "ones the most-routed, in proportion");

namespace nq::tools {
namespace {

std::vector<std::string> SplitList(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipWhitespace());
}

// --tokens FILE[,FILE...] and --domains, as kld_harness.h reads them.
absl::StatusOr<std::vector<eval::KldDomain>> TokensFromFlags() {
  const std::string tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens.empty()) return absl::InvalidArgumentError("--tokens FILE[,FILE...] is required");
  ASSIGN_OR_RETURN(std::vector<eval::KldDomain> domains, eval::ReadKldTokens(SplitList(tokens)));
  return SelectDomains(std::move(domains), SplitList(absl::GetFlag(FLAGS_domains)));
}

absl::Status WriteJson(const nlohmann::ordered_json& json) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(format::WriteFileAtomic(out, json.dump(2) + "\n"));
  std::fprintf(stderr, "wrote %s\n", out.c_str());
  return absl::OkStatus();
}

// nq kld --prefill_tokens (services/eval/prefill_kld.h).
absl::Status PrefillKld() {
  if (!absl::GetFlag(FLAGS_mode).empty() && absl::GetFlag(FLAGS_mode) != "fixed-set") {
    return absl::InvalidArgumentError(absl::StrCat("--mode ", absl::GetFlag(FLAGS_mode),
                                                   " with --prefill_tokens: the continuation decodes with the fixed "
                                                   "set (leave --mode unset, or fixed-set)"));
  }
  eval::PrefillKldRequest request{.teacher_dir = absl::GetFlag(FLAGS_teacher),
                                  .release_dir = absl::GetFlag(FLAGS_release),
                                  .window = absl::GetFlag(FLAGS_window),
                                  .prefill_tokens = absl::GetFlag(FLAGS_prefill_tokens),
                                  .chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens),
                                  .full_span_tokens = absl::GetFlag(FLAGS_full_span_tokens)};
  ASSIGN_OR_RETURN(request.policy, eval::ParsePrefillPolicy(absl::GetFlag(FLAGS_prefill_mode)));
  ASSIGN_OR_RETURN(request.domains, TokensFromFlags());
  ASSIGN_OR_RETURN(eval::PrefillKldReport report, eval::EvaluatePrefillKld(request));
  std::fputs(eval::PrefillKldReportTable(report).c_str(), stdout);
  return WriteJson(eval::PrefillKldReportJson(report));
}

// nq kld --nvfp4 (services/eval/nvfp4_kld.h).
absl::Status Nvfp4Kld() {
  for (const auto& [flag, set] : {std::pair{"--release", !absl::GetFlag(FLAGS_release).empty()},
                                  std::pair{"--mode", !absl::GetFlag(FLAGS_mode).empty()},
                                  std::pair{"--prefill_tokens", absl::GetFlag(FLAGS_prefill_tokens) != 0}}) {
    if (set) return absl::InvalidArgumentError(absl::StrCat(flag, " does not apply to --nvfp4 (a checkpoint, no release)"));
  }
  eval::Nvfp4KldRequest request{.teacher_dir = absl::GetFlag(FLAGS_teacher),
                                .nvfp4_dir = absl::GetFlag(FLAGS_nvfp4),
                                .window = absl::GetFlag(FLAGS_window)};
  ASSIGN_OR_RETURN(request.gate_up, nvfp4::ParseGateUpScaleMode(absl::GetFlag(FLAGS_nvfp4_gate_up_scale)));
  ASSIGN_OR_RETURN(request.domains, TokensFromFlags());
  ASSIGN_OR_RETURN(eval::Nvfp4KldReport report, eval::EvaluateNvfp4Kld(request));
  std::fputs(eval::Nvfp4KldReportTable(report).c_str(), stdout);
  return WriteJson(eval::Nvfp4KldReportJson(report));
}

absl::Status Kld() {
  if (!absl::GetFlag(FLAGS_nvfp4).empty()) return Nvfp4Kld();
  if (absl::GetFlag(FLAGS_prefill_tokens) != 0) return PrefillKld();
  eval::KldRequest request{.teacher_dir = absl::GetFlag(FLAGS_teacher),
                     .release_dir = absl::GetFlag(FLAGS_release),
                     .window = absl::GetFlag(FLAGS_window),
                     .slots = absl::GetFlag(FLAGS_slots)};
  request.streamer_address = absl::GetFlag(FLAGS_streamer);
  if (absl::GetFlag(FLAGS_mode).empty()) return absl::InvalidArgumentError("--mode is required");
  ASSIGN_OR_RETURN(request.mode, eval::ParseKldMode(absl::GetFlag(FLAGS_mode)));
  ASSIGN_OR_RETURN(request.domains, TokensFromFlags());
  ASSIGN_OR_RETURN(eval::KldRunReport report, eval::EvaluateKld(request));
  std::fputs(eval::KldReportTable(report).c_str(), stdout);
  return WriteJson(eval::KldReportJson(report));
}

absl::Status MtpAcceptanceCommand() {
  const std::string model_dir = absl::GetFlag(FLAGS_model), release = absl::GetFlag(FLAGS_release);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model HF_DIR is required");
  const int64_t window = absl::GetFlag(FLAGS_window);
  if (window < 2) {
    return absl::InvalidArgumentError(absl::StrFormat("--window %d: a window needs at least 2 tokens", window));
  }
  ASSIGN_OR_RETURN(std::vector<eval::KldDomain> domains, TokensFromFlags());
  ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(model_dir));
  RETURN_IF_ERROR(CheckTokenIds(domains, config.vocab_size));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  const model::ModelOptions options{.max_tokens = LongestWindow(domains, window)};
  std::unique_ptr<model::Model> model;
  std::string student = "full precision";
  if (release.empty()) {
    ASSIGN_OR_RETURN(model, model::Model::Load(model_dir, *backend, nullptr, options));
  } else {
    ASSIGN_OR_RETURN(release::ExpertBits bits, release::ParseExpertBits(absl::GetFlag(FLAGS_expert_bits)));
    ASSIGN_OR_RETURN(model, release::LoadModelWithRelease(model_dir, release, bits, *backend, nullptr, options));
    student = "experts from " + release + " at " + absl::GetFlag(FLAGS_expert_bits);
  }
  ASSIGN_OR_RETURN(eval::MtpAcceptanceReport report, eval::MeasureMtpAcceptance(*model, domains, window));
  std::printf("nq mtp-acceptance: %s, window %lld\n", student.c_str(), static_cast<long long>(window));
  std::printf("| domain | drafts | accepted (draft = greedy next) | draft = text |\n| --- | ---: | ---: | ---: |\n");
  nlohmann::ordered_json json = {{"model", model_dir},
                                 {"release", release},
                                 {"expert_bits", release.empty() ? "" : absl::GetFlag(FLAGS_expert_bits)},
                                 {"window", window}};
  auto row = [](const std::string& name, const eval::MtpAcceptance& a) {
    std::printf("| %s | %lld | %.4f | %.4f |\n", name.c_str(), static_cast<long long>(a.drafts), a.rate(),
                a.text_rate());
  };
  auto to_json = [](const eval::MtpAcceptance& a) {
    return nlohmann::ordered_json{{"drafts", a.drafts}, {"acceptance", a.rate()}, {"text_accuracy", a.text_rate()}};
  };
  nlohmann::ordered_json per_domain = nlohmann::ordered_json::object();
  for (const auto& [name, a] : report.domains) {
    row(name, a);
    per_domain[name] = to_json(a);
  }
  if (report.domains.size() != 1) row("all", report.overall);
  json.update(to_json(report.overall));
  json["domains"] = std::move(per_domain);
  return WriteJson(json);
}

}  // namespace

int RunKld(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("kld", absl::InvalidArgumentError("unexpected argument " + args[0]));
  return ReportCommandStatus("kld", Kld());
}

int RunMtpAcceptance(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return ReportCommandStatus("mtp-acceptance", absl::InvalidArgumentError("unexpected argument " + args[0]));
  }
  return ReportCommandStatus("mtp-acceptance", MtpAcceptanceCommand());
}

}  // namespace nq::tools
