#include "services/eval/prefill_kld.h"

#include <chrono>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"
#include "services/release/prefill_experts.h"
#include "services/release/release_experts.h"
#include "services/worker/prefill_record_reader.h"

namespace nq::eval {
namespace {

absl::Status Validate(const PrefillKldRequest& r) {
  if (r.teacher_dir.empty() || r.release_dir.empty()) {
    return absl::InvalidArgumentError("--teacher HF_DIR and --release DIR are required");
  }
  if (r.prefill_tokens < 1 || r.window <= r.prefill_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("--prefill_tokens ", r.prefill_tokens, " with --window ", r.window,
                                                   ": want 1 <= prefill_tokens < window (the rest is scored)"));
  }
  if (r.chunk_tokens < 1 || r.full_span_tokens < 1) {
    return absl::InvalidArgumentError("--prefill_chunk_tokens and --full_span_tokens must be positive");
  }
  return absl::OkStatus();
}

// The student's prefill of `prompt` under the policy; returns the last row's logits.
class PrefillStudent {
 public:
  PrefillStudent(model::Model& model, const release::ReleaseExpertDecoder& decoder, release::PrefillExperts* experts,
                 const PrefillKldRequest& request, PrefillKldReport& report)
      : model_(model), decoder_(decoder), experts_(experts), request_(request), report_(report) {
    for (uint32_t layer : decoder.moe_layer_ids()) {
      for (uint32_t e : decoder.FixedSet(layer)) fixed_.insert({layer, e});
    }
  }

  absl::StatusOr<std::vector<float>> Prefill(std::span<const int32_t> prompt) {
    model_.ResetCache();
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> last;
    if (request_.policy == PrefillPolicy::kLayerMajor4Bit) {
      model_.SetExpertSlotSource(nullptr);  // every packed layer gets the hook's slots
      const release::PrefillExpertStats before = experts_->totals();
      model::Model::LayerMajorOptions options{.chunk_tokens = request_.chunk_tokens};
      options.before_moe = [this](int64_t layer, std::span<const model::MoeRouting> chunks) {
        return experts_->BeforeMoe(layer, chunks);
      };
      experts_->Begin(static_cast<int64_t>(prompt.size()));
      absl::StatusOr<std::vector<float>> logits = model_.PrefillLayerMajor(prompt, options);
      experts_->End();
      ASSIGN_OR_RETURN(last, std::move(logits));
      const release::PrefillExpertStats& after = experts_->totals();
      report_.prefill_calls_4bit += after.calls_4bit - before.calls_4bit;
      report_.prefill_calls += after.calls_4bit + after.calls_2bit - before.calls_4bit - before.calls_2bit;
    } else {
      const bool four = request_.policy == PrefillPolicy::kAll4Bit;
      const int64_t stack = model_.config().num_hidden_layers;
      model_.SetExpertSlotSource([this, four, stack](int64_t layer, int32_t expert, int64_t tokens) -> int32_t {
        if (layer < stack) {
          report_.prefill_calls += static_cast<double>(tokens);
          if (four) report_.prefill_calls_4bit += static_cast<double>(tokens);
        }
        return four ? expert : -1;  // slot e of the layer's records holds expert e
      });
      for (size_t at = 0; at < prompt.size(); at += static_cast<size_t>(request_.chunk_tokens)) {
        ASSIGN_OR_RETURN(last, model_.ForwardLast(prompt.subspan(
                                   at, std::min<size_t>(request_.chunk_tokens, prompt.size() - at))));
      }
    }
    report_.prefill_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report_.prefill_tokens += static_cast<int64_t>(prompt.size());
    // Decoding after the prompt: the fixed set at 4 bits, whatever the prefill ran.
    model_.SetExpertSlotSource([this](int64_t layer, int32_t expert, int64_t) -> int32_t {
      return fixed_.count({static_cast<uint32_t>(layer), static_cast<uint32_t>(expert)}) > 0 ? expert : -1;
    });
    return last;
  }

 private:
  model::Model& model_;
  const release::ReleaseExpertDecoder& decoder_;
  release::PrefillExperts* const experts_;
  const PrefillKldRequest& request_;
  PrefillKldReport& report_;
  std::set<std::pair<uint32_t, uint32_t>> fixed_;
};

}  // namespace

absl::StatusOr<PrefillPolicy> ParsePrefillPolicy(const std::string& text) {
  if (text == "2-bit") return PrefillPolicy::k2Bit;
  if (text == "layer-major-4-bit") return PrefillPolicy::kLayerMajor4Bit;
  if (text == "all-4-bit") return PrefillPolicy::kAll4Bit;
  return absl::InvalidArgumentError(absl::StrCat("--prefill_mode ", text, ": want 2-bit, layer-major-4-bit or all-4-bit"));
}

const char* PrefillPolicyName(PrefillPolicy policy) {
  switch (policy) {
    case PrefillPolicy::k2Bit: return "2-bit";
    case PrefillPolicy::kLayerMajor4Bit: return "layer-major-4-bit";
    case PrefillPolicy::kAll4Bit: return "all-4-bit";
  }
  return "?";
}

absl::StatusOr<PrefillKldReport> EvaluatePrefillKld(const PrefillKldRequest& request) {
  RETURN_IF_ERROR(Validate(request));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  const model::ModelOptions options{.max_tokens = request.window};
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> teacher,
                   model::Model::Load(request.teacher_dir, *backend, nullptr, options));
  RETURN_IF_ERROR(CheckTokenIds(request.domains, teacher->config().vocab_size));
  // Every expert's record is loaded (4 bits), and the slot source picks per call.
  ASSIGN_OR_RETURN(release::ServedModel student,
                   release::LoadServedModel(request.teacher_dir, request.release_dir, release::ExpertBits::k4Bit,
                                            *backend, nullptr, options));
  std::unique_ptr<release::PrefillExperts> experts;
  if (request.policy == PrefillPolicy::kLayerMajor4Bit) {
    release::PrefillExpertsOptions experts_options{.slots = student.model->config().n_routed_experts,
                                                   .full_span_tokens = request.full_span_tokens,
                                                   .decoder_layers = student.model->config().num_hidden_layers};
    // Read as a serving worker reads them (prefill_setup.cc): through the io_uring store.
    absl::StatusOr<std::unique_ptr<worker::RecordStorePrefillReader>> reader =
        worker::RecordStorePrefillReader::Open(request.release_dir, student.decoder->rank());
    if (reader.ok()) {
      experts_options.reader = *std::move(reader);
    } else {
      spdlog::warn("prefill: records read with pread, one after another ({})", reader.status().ToString());
    }
    ASSIGN_OR_RETURN(experts, release::PrefillExperts::Create(*student.decoder, *backend,
                                                              student.model->config().n_routed_experts,
                                                              experts_options));
  }
  PrefillKldReport report;
  report.request = request;
  report.request.domains.clear();
  PrefillStudent prefill(*student.model, *student.decoder, experts.get(), request, report);
  const int64_t vocab = teacher->config().vocab_size;
  std::vector<TokenKl> all;
  for (const KldDomain& domain : request.domains) {
    std::vector<TokenKl> scored;
    for (const std::vector<int32_t>& sequence : domain.sequences) {
      const std::span<const int32_t> ids(sequence);
      for (size_t start = 0; start + request.window <= ids.size(); start += static_cast<size_t>(request.window)) {
        const std::span<const int32_t> w = ids.subspan(start, static_cast<size_t>(request.window));
        const std::span<const int32_t> prompt = w.first(static_cast<size_t>(request.prefill_tokens));
        teacher->ResetCache();
        ASSIGN_OR_RETURN(std::vector<float> p, teacher->ForwardLast(prompt));
        ASSIGN_OR_RETURN(std::vector<float> q, prefill.Prefill(prompt));
        ASSIGN_OR_RETURN(std::vector<TokenKl> rows, KlDivergenceRows(p, q, vocab));
        scored.insert(scored.end(), rows.begin(), rows.end());
        for (size_t b = prompt.size(); b < w.size(); b += kKldBlockTokens) {
          const std::span<const int32_t> block = w.subspan(b, std::min<size_t>(kKldBlockTokens, w.size() - b));
          ASSIGN_OR_RETURN(p, teacher->Forward(block));
          ASSIGN_OR_RETURN(q, student.model->Forward(block));
          ASSIGN_OR_RETURN(rows, KlDivergenceRows(p, q, vocab));
          scored.insert(scored.end(), rows.begin(), rows.end());
        }
        ++report.windows;
      }
    }
    report.kl.domains.push_back({.name = domain.name, .kl = SummarizeKl(scored)});
    all.insert(all.end(), scored.begin(), scored.end());
  }
  if (report.windows == 0) {
    return absl::InvalidArgumentError(absl::StrCat("no sequence holds a window of ", request.window, " tokens"));
  }
  report.kl.overall = SummarizeKl(all);
  return report;
}

nlohmann::ordered_json PrefillKldReportJson(const PrefillKldReport& r) {
  auto kl = [](const KlSummary& s) {
    return nlohmann::ordered_json{{"tokens", s.tokens},           {"mean", s.mean}, {"median", s.median},
                                  {"p99", s.p99}, {"top1_agreement", s.top1_agreement}};
  };
  nlohmann::ordered_json domains = nlohmann::ordered_json::object();
  for (const KldDomainReport& d : r.kl.domains) domains[d.name] = kl(d.kl);
  return {{"teacher", r.request.teacher_dir},
          {"release", r.request.release_dir},
          {"prefill_mode", PrefillPolicyName(r.request.policy)},
          {"window", r.request.window},
          {"prefill_tokens", r.request.prefill_tokens},
          {"chunk_tokens", r.request.chunk_tokens},
          {"full_span_tokens", r.request.full_span_tokens},
          {"windows", r.windows},
          {"kl", kl(r.kl.overall)},
          {"domains", std::move(domains)},
          {"prefill_share_4bit", r.PrefillShare4Bit()},
          {"prefill_tokens_per_second", r.PrefillTokensPerSecond()}};
}

std::string PrefillKldReportTable(const PrefillKldReport& r) {
  std::string out = absl::StrFormat(
      "nq kld --prefill_mode %s: %lld windows of %lld tokens, the first %lld prefilled (chunks of %lld), the rest "
      "decoded with the fixed set\n| domain | tokens | mean KL | median | p99 | top-1 agree |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n",
      PrefillPolicyName(r.request.policy), static_cast<long long>(r.windows), static_cast<long long>(r.request.window),
      static_cast<long long>(r.request.prefill_tokens), static_cast<long long>(r.request.chunk_tokens));
  auto row = [&](const std::string& name, const KlSummary& s) {
    absl::StrAppendFormat(&out, "| %s | %lld | %.5f | %.5f | %.5f | %.4f |\n", name, static_cast<long long>(s.tokens),
                          s.mean, s.median, s.p99, s.top1_agreement);
  };
  for (const KldDomainReport& d : r.kl.domains) row(d.name, d.kl);
  if (r.kl.domains.size() != 1) row("all", r.kl.overall);
  absl::StrAppendFormat(&out, "prefill: %.4f of expert calls at 4 bits; %.0f tokens/s (CPU)\n", r.PrefillShare4Bit(),
                        r.PrefillTokensPerSecond());
  return out;
}

}  // namespace nq::eval
