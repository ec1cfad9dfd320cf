// nq bench-decode: decode tokens/s of a model loaded as nq-worker loads it, with no service in
// the way (services/worker/decode_bench.h says what a step is and what is timed).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/model/model.h"
#include "services/nvfp4/gate_up_repack.h"
#include "services/release/release_experts.h"
#include "services/tools/backend_flags.h"
#include "services/tools/commands.h"
#include "services/worker/arena_geometry.h"
#include "services/worker/decode_bench.h"
#include "services/worker/spec_step_bench.h"
#include "services/worker/worker_mailbox.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, release);
ABSL_DECLARE_FLAG(std::string, expert_bits);
ABSL_DECLARE_FLAG(std::string, kv_cache_dtype);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, nvfp4_gate_up_scale);
ABSL_FLAG(int, prompt_tokens, 128, "bench-decode: prompt length (token ids drawn from --seed)");
ABSL_FLAG(int, warmup, 4, "bench-decode: untimed decode steps after the prefill");
ABSL_FLAG(int, decode_tokens, 64, "bench-decode: timed decode steps, one token each");
// Not --temperature: probe-utf8 owns that flag of the nq binary (with another default).
ABSL_FLAG(float, sampling_temperature, 0,
          "bench-decode: the request's temperature (0: greedy; a draw is seeded by --seed)");
ABSL_FLAG(float, sampling_top_p, 1, "bench-decode: the request's nucleus top_p, in (0, 1]");
ABSL_FLAG(int, sampling_top_k, 0, "bench-decode: the request's top-k (0: off)");
ABSL_FLAG(float, sampling_frequency_penalty, 0,
          "bench-decode: the request's frequency penalty, in [-2, 2] (0: none; its logits come to the host only "
          "with --device_logit_adjust=false)");
ABSL_FLAG(bool, device_logit_adjust, true,
          "bench-decode: with --device_sampling, a penalised request draws in the step graph too (as nq-worker "
          "--device_logit_adjust)");
ABSL_FLAG(bool, device_sampling, true,
          "bench-decode: sample inside the step graph (as nq-worker --device_sampling); false brings every "
          "step's logits to the host");
// The names for the same two numbers: decode at a context of N tokens for N steps.
ABSL_FLAG(int, context, 0, "bench-decode: decode at this context (sets --prompt_tokens; 0: use --prompt_tokens)");
ABSL_FLAG(int, steps, 0, "bench-decode: timed decode steps (sets --decode_tokens; 0: use --decode_tokens)");
// nq-worker's default, so the KV cache is the one a served model allocates.
ABSL_FLAG(int64_t, max_model_len, 4096,
          "bench-decode, bench-prefill: context window (tokens the KV cache holds; bench-prefill: at least the longest "
          "prompt and its first token)");
ABSL_FLAG(int64_t, copy_mb, -1,
          "bench-decode: MB of the device copy timed for the roofline floor (0: none; -1: 1024 on cuda, 0 on cpu)");
ABSL_FLAG(std::string, weight_dtype, "f32", "bench-decode: storage of the weight matrices, f32, bf16 or fp8 (as nq-worker)");
ABSL_FLAG(bool, step_graphs, true,
          "bench-decode: run decode steps as captured graphs where the backend can (as nq-worker's --step_graphs)");
ABSL_FLAG(bool, side_streams, true,
          "bench-decode: run a layer's independent ops on a second stream (as nq-worker's --side_streams)");
ABSL_FLAG(bool, fused_residual_norm, true,
          "bench-decode: add each block's residual in the next RmsNorm's kernel (as nq-worker's --fused_residual_norm)");

ABSL_FLAG(int, speculative_tokens, 0,
          "bench-decode: MTP drafts a decode step (0: none), as nq-worker --speculative_tokens, drafted on the backend "
          "with --device_sampling: tokens/s then counts every token a step emits; warm-up and decode are counted in "
          "tokens");
ABSL_FLAG(int, spec_drafts, 0,
          "bench-decode: after the decode steps, time a speculative step with this many MTP drafts (1 to 4) at their "
          "context: a plain forward, the 1 + N verification, the drafts chained on the backend and through the host");
ABSL_FLAG(int, spec_rounds, 20, "bench-decode: rounds of --spec_drafts' timing (medians)");

// What a CUDA nq-worker adds to each MoE block (--slot_mailbox auto): its apply op, here over a
// mailbox nothing posts to, so the steps run as without it and only its cost shows.
ABSL_FLAG(bool, slot_mailbox, false,
          "bench-decode: apply an idle slot mailbox as the first op of each MoE block, as a CUDA nq-worker does "
          "(needs --release and --expert_bits=2): its cost per step");

namespace nq::tools {
namespace {

absl::Status BenchDecode() {
  const std::string model_dir = absl::GetFlag(FLAGS_model), release = absl::GetFlag(FLAGS_release);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  const int context = absl::GetFlag(FLAGS_context), steps = absl::GetFlag(FLAGS_steps);
  if (context < 0 || steps < 0) return absl::InvalidArgumentError("--context and --steps must not be negative");
  const worker::DecodeBenchOptions options{
      .prompt_tokens = context > 0 ? context : absl::GetFlag(FLAGS_prompt_tokens),
      .warmup_tokens = absl::GetFlag(FLAGS_warmup),
      .decode_tokens = steps > 0 ? steps : absl::GetFlag(FLAGS_decode_tokens),
      .seed = absl::GetFlag(FLAGS_seed),
      .temperature = absl::GetFlag(FLAGS_sampling_temperature),
      .top_p = absl::GetFlag(FLAGS_sampling_top_p),
      .top_k = absl::GetFlag(FLAGS_sampling_top_k),
      .frequency_penalty = absl::GetFlag(FLAGS_sampling_frequency_penalty),
      .device_sampling = absl::GetFlag(FLAGS_device_sampling),
      .device_logit_adjust = absl::GetFlag(FLAGS_device_logit_adjust),
      .speculative_tokens = absl::GetFlag(FLAGS_speculative_tokens)};
  const int64_t max_model_len = absl::GetFlag(FLAGS_max_model_len);
  if (max_model_len <= 0) return absl::InvalidArgumentError("--max_model_len must be positive");
  // Before the load, which takes minutes on a large model.
  absl::Status fits = worker::CheckDecodeBench(options, max_model_len);
  if (!fits.ok()) return Annotate(fits, "--prompt_tokens, --warmup, --decode_tokens, --max_model_len");
  if (!std::filesystem::is_directory(model_dir)) {
    return absl::NotFoundError(absl::StrCat("--model ", model_dir, ": no such directory"));
  }
  // The streamer raises experts to 4 bits only in a cluster; here the bits are fixed.
  absl::StatusOr<release::ExpertBits> bits = release::ParseExpertBits(absl::GetFlag(FLAGS_expert_bits));
  if (!release.empty() && !bits.ok()) {
    return Annotate(bits.status(), "--expert_bits (dynamic needs the streamer: measure it through the cluster)");
  }
  absl::StatusOr<kernels::DType> kv_dtype = model::ParseKvCacheDType(absl::GetFlag(FLAGS_kv_cache_dtype));
  if (!kv_dtype.ok()) return Annotate(kv_dtype.status(), "--kv_cache_dtype");
  absl::StatusOr<kernels::DType> weight_dtype = model::ParseWeightDType(absl::GetFlag(FLAGS_weight_dtype));
  if (!weight_dtype.ok()) return Annotate(weight_dtype.status(), "--weight_dtype");
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, BackendFromFlags());

  model::ModelOptions model_options;
  model_options.max_tokens = max_model_len;
  model_options.kv_cache_dtype = *kv_dtype;
  model_options.weight_dtype = *weight_dtype;
  model_options.step_graphs = absl::GetFlag(FLAGS_step_graphs);
  model_options.side_streams = absl::GetFlag(FLAGS_side_streams);
  model_options.fused_residual_norm = absl::GetFlag(FLAGS_fused_residual_norm);
  // An NVFP4 checkpoint fuses its gate/up halves as the worker's --nvfp4_gate_up_scale would.
  ASSIGN_OR_RETURN(const nvfp4::GateUpScaleMode gate_up,
                   nvfp4::ParseGateUpScaleMode(absl::GetFlag(FLAGS_nvfp4_gate_up_scale)));
  const auto started = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(release::ServedModel served,
                   release::LoadServedModel(model_dir, release, release.empty() ? release::ExpertBits::k2Bit : *bits,
                                            *backend, nullptr, model_options, {.gate_up = gate_up}));
  model::Model& model = *served.model;
  std::fprintf(stderr, "nq bench-decode: loaded %s (%s) in %.2f s on %s; KV cache %lld tokens, latent %s\n",
               model_dir.c_str(), std::string(model::ArchitectureName(model.config().architecture)).c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
               backend->DeviceDescription().c_str(), static_cast<long long>(model.max_tokens()),
               std::string(kernels::DTypeName(model.kv_cache_dtype())).c_str());

  std::unique_ptr<worker::WorkerMailbox> mailbox;
  if (absl::GetFlag(FLAGS_slot_mailbox)) {
    if (served.decoder == nullptr || absl::GetFlag(FLAGS_expert_bits) != "2") {
      return absl::InvalidArgumentError("--slot_mailbox needs --release and --expert_bits=2 (nothing is posted to it)");
    }
    ASSIGN_OR_RETURN(const SlotGeometry geometry, worker::ReleaseArenaGeometry(*served.decoder, model.config(), {}));
    ASSIGN_OR_RETURN(mailbox, worker::WorkerMailbox::Create(geometry, 0,
                                                            backend->name() == "cuda"
                                                                ? std::optional<int>(absl::GetFlag(FLAGS_gpu))
                                                                : std::nullopt));
    RETURN_IF_ERROR(model.SetSlotMailbox(mailbox->all_rows(), mailbox->layers()));
  }
  ASSIGN_OR_RETURN(worker::DecodeBenchReport report, worker::RunDecodeBench(model, options));
  const model::Model::StepGraphStats& graphs = model.step_graph_stats();
  std::fprintf(stderr, "nq bench-decode: step graphs %s: %lld captured, %lld replays, %lld warm-up steps%s%s\n",
               model_options.step_graphs ? "on" : "off", static_cast<long long>(graphs.captured),
               static_cast<long long>(graphs.replayed), static_cast<long long>(graphs.warmups),
               graphs.disabled.ok() ? "" : "; turned off after a failed capture: ",
               graphs.disabled.ok() ? "" : std::string(graphs.disabled.message()).c_str());
  std::optional<worker::SpecStepTimes> spec;
  if (const int drafts = absl::GetFlag(FLAGS_spec_drafts); drafts > 0) {
    ASSIGN_OR_RETURN(spec, worker::MeasureSpecStep(model, drafts, absl::GetFlag(FLAGS_spec_rounds)));
  }
  int64_t copy_mb = absl::GetFlag(FLAGS_copy_mb);
  if (copy_mb < 0) copy_mb = backend->name() == "cuda" ? 1024 : 0;
  if (copy_mb > 0) {
    // After the steps, in the same process: the yardstick of this run's roofline ratio.
    ASSIGN_OR_RETURN(report.copy_bytes_per_second, worker::MeasureCopyBandwidth(*backend, copy_mb << 20, 20));
  }
  const worker::DecodeBenchSetup setup{.model = model_dir,
                                       .release = release,
                                       .expert_bits = absl::GetFlag(FLAGS_expert_bits),
                                       .backend = std::string(backend->name()),
                                       .device = backend->DeviceDescription(),
                                       .kv_cache_dtype = absl::GetFlag(FLAGS_kv_cache_dtype),
                                       .weight_dtype = absl::GetFlag(FLAGS_weight_dtype),
                                       .max_model_len = model.max_tokens()};
  if (mailbox != nullptr) std::fprintf(stderr, "nq bench-decode: slot mailbox applied in every MoE block\n");
  if (spec.has_value()) std::printf("nq bench-decode: %s\n", worker::SpecStepSummary(*spec).c_str());
  std::printf("%s\n", worker::DecodeBenchSummary(setup, report).c_str());
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    nlohmann::ordered_json json = worker::DecodeBenchJson(setup, report);
    if (spec.has_value()) json["spec_step"] = worker::SpecStepJson(*spec);
    RETURN_IF_ERROR(format::WriteFileAtomic(out, json.dump(2) + "\n"));
    std::fprintf(stderr, "wrote %s\n", out.c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchDecode(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return ReportCommandStatus("bench-decode", absl::InvalidArgumentError("unexpected argument " + args[0]));
  }
  return ReportCommandStatus("bench-decode", BenchDecode());
}

}  // namespace nq::tools
