#include "services/worker/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"
#include "services/worker/mtp_drafter.h"
#include "services/worker/sampler.h"
#include "services/worker/sequence_runner.h"

namespace nq::worker {

double DecodeBenchReport::decode_seconds() const {
  double total = 0;
  for (double s : step_seconds) total += s;
  return total;
}

double DecodeBenchReport::tokens_per_second() const {
  const double seconds = decode_seconds();
  int64_t emitted = static_cast<int64_t>(step_seconds.size());  // one a step without drafts
  if (!step_tokens.empty()) {
    emitted = 0;
    for (int n : step_tokens) emitted += n;
  }
  return seconds > 0 ? static_cast<double>(emitted) / seconds : 0;
}

double DecodeBenchReport::StepMillisecondsAt(double fraction) const {
  if (step_seconds.empty()) return 0;
  std::vector<double> sorted = step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double rank = std::ceil(fraction * static_cast<double>(sorted.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(sorted.size()))) - 1;
  return sorted[index] * 1e3;
}

double DecodeBenchReport::mean_step_bytes() const {
  if (step_bytes.empty()) return 0;
  double total = 0;
  for (int64_t b : step_bytes) total += static_cast<double>(b);
  return total / static_cast<double>(step_bytes.size());
}

double DecodeBenchReport::RooflineRatio() const {
  const double step_ms = StepMillisecondsAt(0.5);
  if (copy_bytes_per_second <= 0 || step_ms <= 0) return 0;
  return mean_step_bytes() / copy_bytes_per_second * 1e3 / step_ms;
}

absl::StatusOr<double> MeasureCopyBandwidth(kernels::Backend& backend, int64_t bytes, int rounds) {
  if (bytes <= 0 || rounds <= 0) return absl::InvalidArgumentError("copy bandwidth: bytes and rounds must be positive");
  const int64_t floats = bytes / static_cast<int64_t>(sizeof(float));
  ASSIGN_OR_RETURN(kernels::Tensor a, backend.Allocate(kernels::DType::kF32, kernels::Shape{floats}));
  ASSIGN_OR_RETURN(kernels::Tensor b, backend.Allocate(kernels::DType::kF32, kernels::Shape{floats}));
  RETURN_IF_ERROR(backend.Copy(a, b));  // untimed: first touch, clocks up
  RETURN_IF_ERROR(backend.Synchronize());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) RETURN_IF_ERROR(backend.Copy(i % 2 == 0 ? a : b, i % 2 == 0 ? b : a));
  RETURN_IF_ERROR(backend.Synchronize());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return seconds > 0 ? 2.0 * static_cast<double>(floats * sizeof(float)) * rounds / seconds : 0.0;
}

std::vector<int32_t> DecodeBenchPrompt(int64_t prompt_tokens, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(std::max<int64_t>(prompt_tokens, 0)));
  for (int64_t i = 0; i < prompt_tokens; ++i) {
    ids.push_back(static_cast<int32_t>(PositionSeed(seed, static_cast<uint64_t>(i)) % static_cast<uint64_t>(vocab)));
  }
  return ids;
}

absl::Status CheckDecodeBench(const DecodeBenchOptions& options, int64_t context_window) {
  if (options.prompt_tokens < 1 || options.warmup_tokens < 0 || options.decode_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prompt ", options.prompt_tokens, ", warm-up ",
                                                   options.warmup_tokens, ", decode ", options.decode_tokens,
                                                   " tokens: want at least 1 prompt token, 0 or more warm-up "
                                                   "steps and at least 1 decode step"));
  }
  if (options.speculative_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("speculative tokens ", options.speculative_tokens, " < 0"));
  }
  if (absl::StatusOr<Sampler> sampler = Sampler::Create(
          {.temperature = options.temperature, .top_p = options.top_p, .top_k = options.top_k});
      !sampler.ok()) {
    return sampler.status();
  }
  // The worker's count (SequenceRunner): prompt + completion tokens within the window; the
  // prefill emits the first completion token.
  const int64_t needed = options.prompt_tokens + 1 + options.warmup_tokens + options.decode_tokens;
  if (needed > context_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.prompt_tokens, " prompt tokens + 1 from the prefill + ", options.warmup_tokens, " warm-up + ",
        options.decode_tokens, " decode tokens = ", needed, " tokens exceed the context window of ", context_window));
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeBenchReport> RunDecodeBench(model::Model& model, const DecodeBenchOptions& options) {
  RETURN_IF_ERROR(CheckDecodeBench(options, model.max_tokens()));
  if (options.speculative_tokens > 0 && !model.has_mtp()) {
    return absl::FailedPreconditionError(absl::StrCat(
        options.speculative_tokens, " speculative tokens need an MTP layer",
        model.mtp_missing().empty() ? " (num_nextn_predict_layers is 0)" : absl::StrCat(": ", model.mtp_missing())));
  }
  model.ResetCache();
  SequenceRunner runner(&model, /*eos_token_ids=*/{});
  runner.SetDeviceSampling(options.device_sampling);
  runner.SetDeviceLogitAdjust(options.device_logit_adjust);
  MtpDrafter drafter(&model);
  if (options.speculative_tokens > 0) {
    drafter.SetDraftOnDevice(options.device_sampling);  // as nq-worker
    runner.SetDrafter(&drafter, options.speculative_tokens);
  }
  SequenceRequest request;
  request.prompt = DecodeBenchPrompt(options.prompt_tokens, model.config().vocab_size, options.seed);
  request.sampling.temperature = options.temperature;  // 0: greedy
  request.sampling.top_p = options.top_p;
  request.sampling.top_k = options.top_k;
  request.sampling.seed = options.seed;
  request.sampling.frequency_penalty = options.frequency_penalty;
  request.sampling.logprobs = false;  // as the router asks for a request that wants none
  request.max_tokens = static_cast<uint32_t>(1 + options.warmup_tokens + options.decode_tokens);
  request.ignore_eos = true;  // every run decodes all its steps, whatever the tokens
  DecodeBenchReport report;
  report.options = options;
  int64_t step_index = 0;  // 0: the prefill; then warm-up steps; then the timed ones
  int64_t emitted = 0;     // tokens before the step (the prefill's first, then the steps')
  absl::Status failed;
  // The routed experts each forward reads (the observer sees every MoE layer's routing of it).
  int64_t routed_bytes = 0;
  model.SetRoutingObserver([&](int64_t layer, const model::MoeRouting& routing) {
    routed_bytes += model.RoutedExpertStepBytes(layer, routing.experts);
  });
  // Step times are the runner's steady_clock around the forward and the selection. On CUDA
  // that is the device's time too, not just the launches': the forward hands its logits (or, as
  // a step graph, the sampled token) to the host and waits for the copy, which completes only
  // once the work enqueued before it is done, and the next step needs it.
  const bool drafts = options.speculative_tokens > 0;
  model::Model::StepGraphStats before_timed = model.step_graph_stats();  // as the timed steps begin
  auto emit = [&](const SequenceStep& step) {
    if (step.tokens.empty() || (!drafts && step.tokens.size() != 1)) {
      failed = absl::InternalError(absl::StrCat("step ", step_index, " emitted ", step.tokens.size(),
                                                " tokens; a plain decode step emits 1"));
      return false;
    }
    if (step_index == 0) {
      report.prefill_seconds = step.seconds;
    } else if (emitted > options.warmup_tokens) {  // the prefill's token and the warm-up's before it
      report.step_seconds.push_back(step.seconds);
      for (const SampledToken& t : step.tokens) report.tokens.push_back(t.id);
      if (drafts) {
        report.step_tokens.push_back(static_cast<int>(step.tokens.size()));
        report.drafts_verified += step.drafts;
        report.drafts_accepted += step.accepted;
      } else {
        // The step appended one token: it ran at the context before it.
        report.step_bytes.push_back(model.DecodeStepBytes(model.cache_length() - 1) + routed_bytes);
      }
    }
    routed_bytes = 0;
    emitted += static_cast<int64_t>(step.tokens.size());
    ++step_index;
    if (emitted == 1 + options.warmup_tokens) before_timed = model.step_graph_stats();
    return true;
  };
  const absl::Status ran = runner.Run(request, emit, [] { return false; }).status();
  model.SetRoutingObserver(nullptr);
  const model::Model::StepGraphStats& after = model.step_graph_stats();
  report.graphed_steps = after.timed_forwards - before_timed.timed_forwards;
  if (report.graphed_steps > 0) {
    const double n = static_cast<double>(report.graphed_steps) * 1e3;  // ns -> us, per step
    report.host_before_launch_us = static_cast<double>(after.host_before_launch_ns - before_timed.host_before_launch_ns) / n;
    report.launch_and_wait_us = static_cast<double>(after.launch_and_wait_ns - before_timed.launch_and_wait_ns) / n;
    report.host_after_wait_us = static_cast<double>(after.host_after_wait_ns - before_timed.host_after_wait_ns) / n;
  }
  RETURN_IF_ERROR(ran);
  RETURN_IF_ERROR(failed);
  if (emitted != 1 + options.warmup_tokens + options.decode_tokens || report.step_seconds.empty()) {
    return absl::InternalError(absl::StrCat("the sequence ended after ", emitted, " tokens in ", step_index,
                                            " steps; wanted 1 + ", options.warmup_tokens, " + ", options.decode_tokens,
                                            " tokens, some of them timed"));
  }
  return report;
}

std::string DecodeBenchSummary(const DecodeBenchSetup& setup, const DecodeBenchReport& report) {
  const std::string experts = setup.release.empty() ? "checkpoint experts"
                                                    : absl::StrCat("release experts, --expert_bits ", setup.expert_bits);
  std::string line = absl::StrFormat(
      "nq bench-decode: %s (%s) on %s: %.2f tokens/s over %d decode steps (%.3f ms/%s p50, %.3f p90) after a "
      "%d-token prompt (prefill %.3f s) and %d warm-up tokens",
      setup.model, experts, setup.device, report.tokens_per_second(), static_cast<int>(report.step_seconds.size()),
      report.StepMillisecondsAt(0.5), report.options.speculative_tokens > 0 ? "step" : "token",
      report.StepMillisecondsAt(0.9), report.options.prompt_tokens, report.prefill_seconds,
      report.options.warmup_tokens);
  if (report.options.speculative_tokens > 0) {
    absl::StrAppendFormat(&line, "; %d MTP drafts a step: %lld of %lld accepted, %.2f tokens a step",
                          report.options.speculative_tokens, static_cast<long long>(report.drafts_accepted),
                          static_cast<long long>(report.drafts_verified),
                          static_cast<double>(report.tokens.size()) / static_cast<double>(report.step_seconds.size()));
    return line;
  }
  absl::StrAppendFormat(&line, "; %.1f MB read per step", report.mean_step_bytes() / 1e6);
  if (report.graphed_steps > 0) {
    absl::StrAppendFormat(&line, "; host %.1f us before each graph's launch, %.1f after its outputs",
                          report.host_before_launch_us, report.host_after_wait_us);
  }
  if (report.copy_bytes_per_second > 0) {
    absl::StrAppendFormat(&line, "; copy %.0f GB/s, floor %.3f ms, roofline ratio %.3f",
                          report.copy_bytes_per_second / 1e9, report.mean_step_bytes() / report.copy_bytes_per_second * 1e3,
                          report.RooflineRatio());
  }
  return line;
}

nlohmann::ordered_json DecodeBenchJson(const DecodeBenchSetup& setup, const DecodeBenchReport& report) {
  nlohmann::ordered_json json = {{"model", setup.model},
                                 {"release", setup.release},
                                 {"expert_bits", setup.release.empty() ? "" : setup.expert_bits},
                                 {"backend", setup.backend},
                                 {"device", setup.device}};
  if (setup.backend == "cuda") json["gpu"] = setup.device;
  std::vector<double> step_ms;
  for (double s : report.step_seconds) step_ms.push_back(s * 1e3);
  json.update(nlohmann::ordered_json{{"kv_cache_dtype", setup.kv_cache_dtype},
                                     {"weight_dtype", setup.weight_dtype},
                                     {"max_model_len", setup.max_model_len},
                                     {"seed", report.options.seed},
                                     {"temperature", report.options.temperature},
                                     {"top_p", report.options.top_p},
                                     {"top_k", report.options.top_k},
                                     {"frequency_penalty", report.options.frequency_penalty},
                                     {"device_sampling", report.options.device_sampling},
                                     {"device_logit_adjust", report.options.device_logit_adjust},
                                     {"speculative_tokens", report.options.speculative_tokens},
                                     {"drafts_verified", report.drafts_verified},
                                     {"drafts_accepted", report.drafts_accepted},
                                     {"prompt_tokens", report.options.prompt_tokens},
                                     {"warmup_tokens", report.options.warmup_tokens},
                                     {"decode_tokens", report.options.decode_tokens},
                                     {"prefill_seconds", report.prefill_seconds},
                                     {"decode_seconds", report.decode_seconds()},
                                     {"tokens_per_second", report.tokens_per_second()},
                                     {"ms_per_token_p50", report.StepMillisecondsAt(0.5)},
                                     {"ms_per_token_p90", report.StepMillisecondsAt(0.9)},
                                     {"bytes_per_step", report.mean_step_bytes()},
                                     {"copy_gb_per_s", report.copy_bytes_per_second / 1e9},
                                     {"floor_ms", report.copy_bytes_per_second > 0
                                                      ? report.mean_step_bytes() / report.copy_bytes_per_second * 1e3
                                                      : 0.0},
                                     {"roofline_ratio", report.RooflineRatio()},
                                     {"graphed_steps", report.graphed_steps},
                                     {"host_us_before_launch", report.host_before_launch_us},
                                     {"launch_and_wait_us", report.launch_and_wait_us},
                                     {"host_us_after_wait", report.host_after_wait_us},
                                     {"step_ms", step_ms},
                                     {"tokens", report.tokens}});
  return json;
}

}  // namespace nq::worker
