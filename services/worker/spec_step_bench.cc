#include "services/worker/spec_step_bench.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Milliseconds `run` takes; every model call returns with its results on the host, so this is
// the device's time too.
absl::StatusOr<double> TimeMs(const std::function<absl::Status()>& run) {
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(run());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

int32_t Argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

}  // namespace

absl::StatusOr<SpecStepTimes> MeasureSpecStep(model::Model& model, int drafts, int rounds) {
  if (drafts < 1 || drafts > model::Model::kMaxStepGraphTokens || rounds < 1) {
    return absl::InvalidArgumentError(absl::StrCat("spec step: ", drafts, " drafts (1 to ",
                                                   model::Model::kMaxStepGraphTokens, ") over ", rounds, " rounds"));
  }
  if (!model.has_mtp()) return absl::FailedPreconditionError("spec step: the model has no MTP layer");
  const int64_t context = model.cache_length();
  if (context < 1 || context + 1 + drafts > model.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("spec step: a context of ", context, " tokens in a window of ",
                                                   model.max_tokens(), " leaves no room for 1 + ", drafts));
  }
  const int64_t D = model.config().hidden_size;
  const int32_t token = 1 % static_cast<int32_t>(model.config().vocab_size);
  // The MTP cache at the main cache's length, as a served sequence has it.
  const int64_t mtp_before = model.mtp_cache_length();
  // In chunks, as the runner feeds a long prompt's entries (a prefill's scratch grows with them).
  constexpr int64_t kChunk = 512;
  for (int64_t at = mtp_before; at < context; at += kChunk) {
    const std::vector<int32_t> ids(static_cast<size_t>(std::min(kChunk, context - at)), token);
    const std::vector<float> zeros(ids.size() * static_cast<size_t>(D), 0.0f);
    RETURN_IF_ERROR(model.ForwardMtpLast(ids, zeros).status());
  }
  const int64_t mtp_length = model.mtp_cache_length();
  const std::vector<int32_t> verify(static_cast<size_t>(1 + drafts), token);
  const std::vector<int32_t> plain(1, token);
  const kernels::SampleParams greedy{};
  SpecStepTimes times{.drafts = drafts, .rounds = rounds, .context = context};
  std::vector<double> plain_ms, verify_ms, chained_ms, chained_verified_ms, observed_ms, host_ms;
  std::vector<float> hidden, verified_hidden;
  for (int round = 0; round < rounds; ++round) {
    ASSIGN_OR_RETURN(const double p, TimeMs([&] { return model.Forward(plain).status(); }));
    plain_ms.push_back(p);
    hidden = model.last_hidden();
    RETURN_IF_ERROR(model.TruncateCache(context));
    ASSIGN_OR_RETURN(const double v, TimeMs([&] { return model.Forward(verify).status(); }));
    verify_ms.push_back(v);
    verified_hidden = model.last_hidden();
    RETURN_IF_ERROR(model.TruncateCache(context));
    RETURN_IF_ERROR(model.TruncateMtpCache(mtp_length));
    ASSIGN_OR_RETURN(const double c, TimeMs([&] { return model.DraftOnDevice(plain, hidden, drafts, greedy).status(); }));
    chained_ms.push_back(c);
    RETURN_IF_ERROR(model.TruncateMtpCache(mtp_length));
    ASSIGN_OR_RETURN(const double cv, TimeMs([&] {
                       return model.DraftOnDevice(verify, verified_hidden, drafts, greedy).status();
                     }));
    chained_verified_ms.push_back(cv);
    RETURN_IF_ERROR(model.TruncateMtpCache(mtp_length));

    ASSIGN_OR_RETURN(const double h, TimeMs([&]() -> absl::Status {
                       ASSIGN_OR_RETURN(std::vector<float> logits, model.ForwardMtpLast(plain, hidden));
                       std::vector<int32_t> drafted = {Argmax(logits)};
                       while (static_cast<int>(drafted.size()) < drafts) {
                         const std::vector<float> state = model.last_mtp_hidden();
                         ASSIGN_OR_RETURN(logits, model.ForwardMtpLast(std::span<const int32_t>(&drafted.back(), 1),
                                                                       std::span<const float>(state).last(static_cast<size_t>(D))));
                         drafted.push_back(Argmax(logits));
                       }
                       return absl::OkStatus();
                     }));
    host_ms.push_back(h);
    RETURN_IF_ERROR(model.TruncateMtpCache(mtp_length));
  }
  // As a worker drafts: with a routing observer (every MoE forward then logs its routing and
  // its inputs' norms). Setting one drops the captured graphs: two more rounds warm up and
  // capture again, untimed.
  model.SetRoutingObserver([](int64_t, const model::MoeRouting&) {});
  for (int round = -2; round < rounds; ++round) {
    ASSIGN_OR_RETURN(const double o, TimeMs([&] { return model.DraftOnDevice(plain, hidden, drafts, greedy).status(); }));
    if (round >= 0) observed_ms.push_back(o);
    RETURN_IF_ERROR(model.TruncateMtpCache(mtp_length));
  }
  model.SetRoutingObserver(nullptr);
  RETURN_IF_ERROR(model.TruncateMtpCache(std::min(mtp_before, mtp_length)));
  times.plain_ms = Median(plain_ms);
  times.verify_ms = Median(verify_ms);
  times.chained_drafts_ms = Median(chained_ms);
  times.chained_from_verified_ms = Median(chained_verified_ms);
  times.host_drafts_ms = Median(host_ms);
  times.observed_drafts_ms = Median(observed_ms);
  return times;
}

std::string SpecStepSummary(const SpecStepTimes& t) {
  return absl::StrFormat(
      "spec step, %d drafts at context %d (%d rounds, medians): plain %.3f ms, 1 + %d verification %.3f ms (%.2fx), "
      "drafts chained %.3f ms (%.3f from all %d verified rows; %.3f with a routing observer, as a worker), through "
      "the host %.3f ms; verification + chained drafts %.2fx a plain step",
      t.drafts, t.context, t.rounds, t.plain_ms, t.drafts, t.verify_ms, t.verify_ms / t.plain_ms, t.chained_drafts_ms,
      t.chained_from_verified_ms, 1 + t.drafts, t.observed_drafts_ms, t.host_drafts_ms,
      (t.verify_ms + t.chained_drafts_ms) / t.plain_ms);
}

nlohmann::ordered_json SpecStepJson(const SpecStepTimes& t) {
  return {{"drafts", t.drafts},
          {"rounds", t.rounds},
          {"context", t.context},
          {"plain_ms", t.plain_ms},
          {"verify_ms", t.verify_ms},
          {"chained_drafts_ms", t.chained_drafts_ms},
          {"chained_from_verified_ms", t.chained_from_verified_ms},
          {"observed_drafts_ms", t.observed_drafts_ms},
          {"host_drafts_ms", t.host_drafts_ms},
          {"verify_over_plain", t.verify_ms / t.plain_ms},
          {"step_over_plain", (t.verify_ms + t.chained_drafts_ms) / t.plain_ms}};
}

}  // namespace nq::worker
