// The worker's decode speed with no service in the way (`nq bench-decode`, issues #13 and #14):
// the leader's SequenceRunner, greedy, without drafts, on a model loaded as nq-worker loads it.
// What the HTTP stream's tokens/s is compared with: the difference is what the services cost.
//
// One run: a prompt of P token ids (PositionSeed of the seed, so the same seed gives the same
// prompt on every machine), its prefill (which emits the first token), W warm-up decode steps,
// then N timed decode steps. A decode step is exactly the worker's plain step: the model's
// forward of the last token (appended to the cache, so the sequence continues from the prompt),
// greedy selection on the host (Sampler, without log-probabilities: what an HTTP request that
// asks for none gets), nothing else. Each step's wall time is the runner's
// steady_clock measurement of its forward and sampling (SequenceStep::seconds).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/model/model.h"

namespace nq::worker {

struct DecodeBenchOptions {
  int64_t prompt_tokens = 128;
  int64_t warmup_tokens = 4;
  int64_t decode_tokens = 64;
  uint64_t seed = 0;
  // The draw (greedy by default; --seed seeds a stochastic one): the request's sampling, which
  // a step graph runs on the device (Backend::SampleTokens).
  float temperature = 0;
  float top_p = 1;
  int top_k = 0;
  // A frequency penalty on the request (0: none): with device_logit_adjust, its draw stays in the
  // step graph (the delta row added there), else its logits come to the host.
  float frequency_penalty = 0;
  // SequenceRunner::SetDeviceSampling (nq-worker's default); off, every step's logits come to
  // the host.
  bool device_sampling = true;
  // SequenceRunner::SetDeviceLogitAdjust (nq-worker --device_logit_adjust, on by default).
  bool device_logit_adjust = true;
  // MTP drafts a step (0: none), as nq-worker --speculative_tokens: an MtpDrafter drafting on the
  // backend with device_sampling. A step then emits 1 + its accepted drafts; warm-up and timed
  // runs are counted in tokens, and a step that starts inside the warm-up is not timed.
  int speculative_tokens = 0;
};

struct DecodeBenchReport {
  DecodeBenchOptions options;
  double prefill_seconds = 0;      // the prompt's forward and the first token's selection
  std::vector<double> step_seconds;  // each timed step ([decode_tokens] without drafts)
  std::vector<int32_t> tokens;       // the tokens the timed steps emitted, in order
  std::vector<int> step_tokens;      // with drafts: the tokens each timed step emitted
  int64_t drafts_verified = 0;       // with drafts: over the timed steps
  int64_t drafts_accepted = 0;
  // [decode_tokens]: the bytes each timed step had to read (Model::DecodeStepBytes at its
  // context plus Model::RoutedExpertStepBytes of the experts it routed to). Empty with drafts
  // (a verification's and its drafts' bytes are not counted), and no roofline ratio then.
  std::vector<int64_t> step_bytes;
  // Device copy bandwidth measured in the same run, (read + write) bytes per second as the
  // hbm_probe yardstick counts it; 0 when not measured.
  double copy_bytes_per_second = 0;
  // The timed steps that ran as step graphs, and the host's time in each, on average
  // (Model::StepGraphStats): before the launch, the launch and the wait for the outputs, after.
  // The GPU idles in the first and last (bench/README.md, "The decode step as it runs").
  int64_t graphed_steps = 0;
  double host_before_launch_us = 0;
  double launch_and_wait_us = 0;
  double host_after_wait_us = 0;

  double mean_step_bytes() const;
  // The roofline floor of a step (mean bytes / copy bandwidth) over the median step: 1 is a
  // step at copy speed. 0 without a copy measurement.
  double RooflineRatio() const;

  double decode_seconds() const;
  double tokens_per_second() const;  // the timed tokens over the timed steps' seconds
  // The nearest-rank percentile of the timed steps in milliseconds: the smallest step time
  // that at least `fraction` of the steps do not exceed.
  double StepMillisecondsAt(double fraction) const;
};

// P token ids below `vocab`: id i is PositionSeed(seed, i) mod vocab.
std::vector<int32_t> DecodeBenchPrompt(int64_t prompt_tokens, int64_t vocab, uint64_t seed);

// INVALID_ARGUMENT, naming the numbers, unless P >= 1, W >= 0, N >= 1 and the sequence fits
// `context_window` as the worker counts it: prompt plus completion tokens (1 from the prefill,
// W, N) at most the window.
absl::Status CheckDecodeBench(const DecodeBenchOptions& options, int64_t context_window);

// Runs the benchmark on `model` (its cache is reset first and holds the sequence after).
absl::StatusOr<DecodeBenchReport> RunDecodeBench(model::Model& model, const DecodeBenchOptions& options);

// What ran, for the report: the caller's labels.
struct DecodeBenchSetup {
  std::string model;
  std::string release;      // empty: the checkpoint's experts
  std::string expert_bits;  // with a release
  std::string backend;
  std::string device;       // Backend::DeviceDescription()
  std::string kv_cache_dtype;
  std::string weight_dtype = "f32";
  int64_t max_model_len = 0;
};

// Times `rounds` device-to-device copies of a `bytes` buffer on `backend` (after one untimed) and
// returns (read + write) bytes per second.
absl::StatusOr<double> MeasureCopyBandwidth(kernels::Backend& backend, int64_t bytes, int rounds);

// One line for people: tokens/s, ms per token p50 / p90, prefill time, bytes per step and the
// roofline ratio when measured.
std::string DecodeBenchSummary(const DecodeBenchSetup& setup, const DecodeBenchReport& report);
// {model, release, expert_bits, backend, device, gpu (cuda only), kv_cache_dtype,
//  max_model_len, seed, prompt_tokens, warmup_tokens, decode_tokens, prefill_seconds,
//  decode_seconds, tokens_per_second, ms_per_token_p50, ms_per_token_p90, bytes_per_step,
//  copy_gb_per_s, floor_ms, roofline_ratio, step_ms, tokens}.
nlohmann::ordered_json DecodeBenchJson(const DecodeBenchSetup& setup, const DecodeBenchReport& report);

}  // namespace nq::worker
