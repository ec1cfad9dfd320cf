// nq encode, nq verify, nq assemble, nq bench-codec: the NestQuant release tools.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "services/common/progress.h"
#include "services/common/status_macros.h"
#include "services/eval/release_kl.h"
#include "services/format/assemble.h"
#include "services/format/verify.h"
#include "services/quant/codec_bench.h"
#include "services/quant/trellis_codec.h"
#include "services/quant/trellis_search.h"
#include "services/release/calibration.h"
#include "services/release/release_encoder.h"
#include "services/release/release_experts.h"
#include "services/tools/commands.h"

#if NQ_HAVE_CUDA
#include "kernels/cuda/trellis_search.h"
#endif

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int, tp);
ABSL_DECLARE_FLAG(std::string, tokens);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_FLAG(int, fixed_per_layer, 0, "encode, synth-release: experts per layer pinned at 4 bits by default");
ABSL_FLAG(std::string, calib, "", "encode: calibration Hessians and routing counts from nq calibrate");
ABSL_FLAG(std::string, codec, "scalar",
          "encode: the codec, scalar (nested_scalar_v1) or trellis (trellis_v1, ~2x lower 2-bit "
          "MSE, Viterbi encode ~1000x slower)");
ABSL_FLAG(std::string, device, "cpu",
          "encode, synth-release, bench-codec: where experts are encoded: cpu (one expert per core), cuda, cuda:N or "
          "cuda:N,M,... (two experts at once per GPU, trellis_v1's tiles searched on those sm_90 GPUs); the release's "
          "bytes are the same");
ABSL_FLAG(std::string, base_levels, "uniform",
          "encode: nested_scalar_v1's levels, uniform (2-bit levels on an even grid: the GPU's fast 2-bit decode, "
          "1.2% more 2-bit MSE), lloyd (free levels, decoded by table lookups) or uniform_nested (the 4-bit levels "
          "on the even grid nested in the base's too: the fast 4-bit decode, more 4-bit MSE; docs/encoding.md)");
ABSL_FLAG(int, codebook_refinements, nq::release::kCodecDefaultRefinements,
          "encode: Lloyd refits of each scalar matrix's codebook to its own targets, each one more quantisation pass "
          "(with --calib: about a third more encode time, and on glm5_nano mean KL 5 % lower at 2 bits and 11 % at "
          "4); unset: 1 for scalar with --calib, else 0 (trellis: always 0, its codebook is computed); 0 reproduces "
          "releases from before refits (docs/encoding.md)");
ABSL_FLAG(int, workers, 0,
          "encode: experts encoded at once (0: one per core with --device cpu, eight per GPU with --device cuda); "
          "each holds one expert's matrices in memory");
ABSL_FLAG(int, lowrank_rank, 0,
          "encode: rank (1-4) of the low-rank corrections fitted to the quantisation error of expert matrices whose "
          "calibration inputs show outlier channels (needs --calib; issue #16); 0 writes none");
ABSL_FLAG(double, lowrank_outlier_threshold, nq::quant::LowRankOptions{}.outlier_threshold,
          "encode: an input channel is an outlier when its Hessian diagonal exceeds this multiple of the median");
ABSL_FLAG(double, lowrank_min_gain, nq::quant::LowRankOptions{}.min_gain,
          "encode: a correction is kept when it lowers the Hessian-weighted 2-bit error by at least this fraction");
ABSL_FLAG(std::string, codecs, "scalar,trellis", "bench-codec: the codecs to compare, comma-separated");
ABSL_FLAG(std::string, tokens_file, "", "calibrate: token ids, one sequence per line (comma or space separated)");
ABSL_FLAG(std::string, src, "", "assemble: the release to install from");
ABSL_FLAG(std::string, into, "", "assemble: the release directory to install into");
ABSL_FLAG(std::string, layers, "", "assemble: layer range a-b (default: every layer)");
ABSL_FLAG(bool, dry_run, false, "assemble: print the plan and change nothing");
ABSL_FLAG(std::string, kl_models, "",
          "bench-codec: comma-separated HF model directories (with tokens.json) to encode and measure KL on");
ABSL_FLAG(int, size, 1024, "bench-codec: n of the n x n N(0,1) matrix (the issue's table uses 4096)");

namespace nq::tools {
namespace {

// Progress of a long job on stderr: a line redrawn in place on a terminal, a plain line about
// every 30 s otherwise (logs of hours-long encodes).
ProgressReporter MakeProgress(std::string task, std::string unit, std::string work_unit) {
  return ProgressReporter(
      {.task = std::move(task), .unit = std::move(unit), .work_unit = std::move(work_unit), .terminal = StderrIsTerminal()});
}

// --device: where the experts' trellis tiles are searched. cpu: one worker per core, each with a
// one-thread search (scalar encodes parallelise the same way). cuda[:N]: kWorkersPerGpu workers
// sharing each GPU, so while some encode on the host the others' tiles are on the GPU; LDLQ's
// feedback gets the cores between them. `workers` > 0 (--workers) replaces either count.
// Eight a GPU: on the H200 with 16 cores, LDLQ encodes of 7168 x 2048 took 5.89 s a matrix with
// two workers, 4.56 with four and 4.08 with eight (90 % of the search's own rate;
// trellis_search_bench --ldlq_workers, bench/README.md); with the fused-step search, 3.02 s with
// eight and 2.86 with sixteen (an H100). Each worker holds about 0.8 GB of host memory (an expert's
// weights and one matrix's LDLQ streams in double), so sixteen buy 5 % for twice the memory: eight.
absl::Status SetEncodeDevice(const std::string& device, int workers, release::EncodeReleaseOptions& options) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (device == "cpu") {
    options.workers = workers > 0 ? workers : cores;
    options.host_threads = 1;
    options.make_trellis_search = []() -> absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> {
      return quant::MakeCpuTrellisTileSearch(1);
    };
    return absl::OkStatus();
  }
  // cuda, cuda:N or cuda:N,M,...: the GPUs, each taking kWorkersPerGpu workers in turn.
  std::vector<int> gpus;
  if (device == "cuda") {
    gpus.push_back(0);
  } else if (absl::StartsWith(device, "cuda:")) {
    for (absl::string_view part : absl::StrSplit(device.substr(5), ',')) {
      int gpu = -1;
      if (!absl::SimpleAtoi(part, &gpu) || gpu < 0 || std::find(gpus.begin(), gpus.end(), gpu) != gpus.end()) {
        gpus.clear();
        break;
      }
      gpus.push_back(gpu);
    }
  }
  if (gpus.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: expected cpu, cuda or cuda:N[,M...] (distinct GPUs), got '", device, "'"));
  }
#if NQ_HAVE_CUDA
  // Made here once per GPU so a missing or unsuitable one, or one whose search disagrees with the
  // CPU's, is refused before any checkpoint is read.
  for (int gpu : gpus) {
    ASSIGN_OR_RETURN(std::unique_ptr<quant::TrellisTileSearch> probe, kernels::cuda::MakeCudaTrellisTileSearch(gpu));
    RETURN_IF_ERROR(quant::CheckAgreesWithCpuSearch(*probe));
  }
  constexpr int kWorkersPerGpu = 8;
  options.workers = workers > 0 ? workers : kWorkersPerGpu * static_cast<int>(gpus.size());
  options.host_threads = std::max(1, cores / options.workers);
  // EncodeRelease makes one search per worker, one after another: worker w gets GPU w mod n.
  options.make_trellis_search = [gpus, next = std::make_shared<size_t>(0)] {
    return kernels::cuda::MakeCudaTrellisTileSearch(gpus[(*next)++ % gpus.size()]);
  };
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError(
      absl::StrCat("--device=", device, ": this nq was built without CUDA (build the cuda preset)"));
#endif
}

// nq encode, and nq synth-release (the same release with made-up experts: no checkpoint weights read).
int RunEncodeCommand(const char* command, const std::vector<std::string>& args, bool synthetic) {
  if (!args.empty()) return ReportCommandStatus(command, absl::InvalidArgumentError("unexpected argument " + args[0]));
  const std::string model = absl::GetFlag(FLAGS_model), out = absl::GetFlag(FLAGS_out);
  if (model.empty() || out.empty()) return ReportCommandStatus(command, absl::InvalidArgumentError("--model and --out are required"));
  release::EncodeReleaseOptions options;
  options.tp_size = absl::GetFlag(FLAGS_tp);
  options.fixed_per_layer = absl::GetFlag(FLAGS_fixed_per_layer);
  options.codec = absl::GetFlag(FLAGS_codec);
  options.calibration_path = absl::GetFlag(FLAGS_calib);
  absl::StatusOr<quant::BaseGrid> grid = quant::ParseBaseGrid(absl::GetFlag(FLAGS_base_levels));
  if (!grid.ok()) {
    return ReportCommandStatus(command,
                               absl::InvalidArgumentError(absl::StrCat("--base_levels ", grid.status().message())));
  }
  options.base_grid = *grid;
  options.codebook_refinements = absl::GetFlag(FLAGS_codebook_refinements);
  options.lowrank.rank = absl::GetFlag(FLAGS_lowrank_rank);
  options.lowrank.outlier_threshold = absl::GetFlag(FLAGS_lowrank_outlier_threshold);
  options.lowrank.min_gain = absl::GetFlag(FLAGS_lowrank_min_gain);
  if (options.lowrank.rank == 0 && (options.lowrank.outlier_threshold != quant::LowRankOptions{}.outlier_threshold ||
                                    options.lowrank.min_gain != quant::LowRankOptions{}.min_gain)) {
    return ReportCommandStatus(command, absl::InvalidArgumentError(
                                            "--lowrank_outlier_threshold and --lowrank_min_gain apply only with "
                                            "--lowrank_rank 1..4"));
  }
  release::LowRankStats lowrank_stats;
  options.lowrank_stats = &lowrank_stats;
  const std::string device = absl::GetFlag(FLAGS_device);
  const int workers = absl::GetFlag(FLAGS_workers);
  if (workers < 0) return ReportCommandStatus(command, absl::InvalidArgumentError("--workers must be >= 0"));
  if (absl::Status s = SetEncodeDevice(device, workers, options); !s.ok()) return ReportCommandStatus(command, s);
  if (quant::ResolveCodecName(options.codec).value_or("") == quant::kTrellisV1) {
    std::fprintf(stderr, "nq %s: trellis tiles searched on %s, %d experts at once\n", command, device.c_str(),
                 synthetic ? 1 : options.workers);
  }
  ProgressReporter progress = MakeProgress(command, "experts", "weights");
  options.progress = [&progress](const ProgressState& state) { progress.Update(state); };
  if (synthetic) {
    if (!options.calibration_path.empty()) {
      return ReportCommandStatus(command, absl::InvalidArgumentError("--calib: a synthetic release encodes no checkpoint"));
    }
    options.synthetic_seed = absl::GetFlag(FLAGS_seed);
  }
  absl::Status status = release::EncodeRelease(model, out, options);
  progress.Finish();
  if (status.ok() && options.lowrank.rank > 0) {
    const release::LowRankStats& s = lowrank_stats;
    auto ratio = [](double after, double before) { return before > 0 ? after / before : 0.0; };
    std::fprintf(stderr,
                 "nq %s: low-rank rank %d: %lld of %lld matrices have outlier channels, %lld corrected; on those the "
                 "weighted error is x%.4f at 2 bits and x%.4f at 4 bits; %lld resident bytes, %lld record bytes\n",
                 command, options.lowrank.rank, static_cast<long long>(s.with_outliers),
                 static_cast<long long>(s.matrices), static_cast<long long>(s.kept),
                 ratio(s.error2_corrected, s.error2), ratio(s.error4_corrected, s.error4),
                 static_cast<long long>(s.resident_bytes), static_cast<long long>(s.record_bytes));
  }
  if (status.ok()) std::fprintf(stderr, "nq %s: wrote %s\n", command, out.c_str());
  return ReportCommandStatus(command, status);
}

}  // namespace

int RunEncode(const std::vector<std::string>& args) { return RunEncodeCommand("encode", args, false); }

int RunSynthRelease(const std::vector<std::string>& args) { return RunEncodeCommand("synth-release", args, true); }

int RunCalibrate(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("calibrate", absl::InvalidArgumentError("unexpected argument " + args[0]));
  // --tokens names a file here (logits takes the ids themselves).
  const std::string model = absl::GetFlag(FLAGS_model), out = absl::GetFlag(FLAGS_out);
  const std::string tokens =
      !absl::GetFlag(FLAGS_tokens_file).empty() ? absl::GetFlag(FLAGS_tokens_file) : absl::GetFlag(FLAGS_tokens);
  if (model.empty() || tokens.empty() || out.empty()) {
    return ReportCommandStatus("calibrate", absl::InvalidArgumentError("--model, --tokens FILE and --out are required"));
  }
  absl::StatusOr<std::vector<std::vector<int32_t>>> sequences = release::ReadTokenFile(tokens);
  if (!sequences.ok()) return ReportCommandStatus("calibrate", sequences.status());
  ProgressReporter progress = MakeProgress("calibrate", "sequences", "tokens");
  absl::StatusOr<release::Calibration> calibration =
      release::Calibrate(model, *sequences, out, [&progress](const ProgressState& state) { progress.Update(state); });
  progress.Finish();
  if (!calibration.ok()) return ReportCommandStatus("calibrate", calibration.status());
  std::fprintf(stderr, "nq calibrate: %zu sequences, %zu experts seen; wrote %s\n", sequences->size(),
               calibration->experts.size(), out.c_str());
  return 0;
}

int RunVerify(const std::vector<std::string>& args) {
  if (args.size() != 1) return ReportCommandStatus("verify", absl::InvalidArgumentError("usage: nq verify RELEASE"));
  ProgressReporter progress = MakeProgress("verify", "layer files", "B");
  absl::StatusOr<format::VerifyReport> report =
      format::VerifyRelease(args[0], [&progress](const ProgressState& state) { progress.Update(state); });
  progress.Finish();
  if (!report.ok()) return ReportCommandStatus("verify", report.status());
  if (report->ok()) {
    std::printf("%s: every file and range matches its sha256\n", args[0].c_str());
    return 0;
  }
  std::printf("%s", report->ToString().c_str());
  return 1;
}

int RunAssemble(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("assemble", absl::InvalidArgumentError("unexpected argument " + args[0]));
  const std::string src = absl::GetFlag(FLAGS_src), into = absl::GetFlag(FLAGS_into);
  if (src.empty() || into.empty()) return ReportCommandStatus("assemble", absl::InvalidArgumentError("--src and --into are required"));
  format::AssembleOptions options;
  options.dry_run = absl::GetFlag(FLAGS_dry_run);
  if (const std::string layers = absl::GetFlag(FLAGS_layers); !layers.empty()) {
    absl::StatusOr<format::LayerRange> range = format::ParseLayerRange(layers);
    if (!range.ok()) return ReportCommandStatus("assemble", range.status());
    options.layers = *range;
  }
  ProgressReporter progress = MakeProgress("assemble", "(layer, rank) installs", "B");
  options.progress = [&progress](const ProgressState& state) { progress.Update(state); };
  absl::StatusOr<format::AssemblePlan> plan = format::Assemble(src, into, options);
  progress.Finish();
  if (!plan.ok()) return ReportCommandStatus("assemble", plan.status());
  std::printf("%s %zu (layer, rank) installs, %zu already installed%s\n", options.dry_run ? "would do" : "did",
              plan->installs.size(), plan->skipped.size(), plan->complete_after ? "; the release is complete" : "");
  for (const auto& [layer, rank] : plan->installs) std::printf("  layer %u rank %u\n", layer, rank);
  return 0;
}

int RunBenchCodec(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("bench-codec", absl::InvalidArgumentError("unexpected argument " + args[0]));
  const int n = absl::GetFlag(FLAGS_size);
  // The encode-time shape (DeepSeek-V3's expert gate/up: 7168 x 2048), timed on a
  // 128-row slice (one row rotation block) and scaled, single-threaded.
  constexpr int64_t kTimedRows = 7168, kTimedCols = 2048, kTimedSlice = 128;
  // --device cuda[:N]: also a whole matrix of that shape encoded with the GPU's tile search (made
  // first, so a missing GPU is refused before minutes of CPU measurements).
  std::unique_ptr<quant::TrellisTileSearch> device_search;
  if (const std::string device = absl::GetFlag(FLAGS_device); device != "cpu") {
    release::EncodeReleaseOptions encode;
    if (absl::Status s = SetEncodeDevice(device, /*workers=*/0, encode); !s.ok()) {
      return ReportCommandStatus("bench-codec", s);
    }
    absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> search = encode.make_trellis_search();
    if (!search.ok()) return ReportCommandStatus("bench-codec", search.status());
    device_search = *std::move(search);
  }
  struct Row {
    std::string codec;
    quant::GaussianMseReport mse;
    quant::OutputErrorReport out;
    quant::EncodeCostReport cost;
  };
  std::vector<Row> rows;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_codecs), ',', absl::SkipEmpty())) {
    absl::StatusOr<std::string> codec = quant::ResolveCodecName(name);
    if (!codec.ok()) return ReportCommandStatus("bench-codec", codec.status());
    Row& row = rows.emplace_back();
    row.codec = *codec;
    absl::StatusOr<quant::GaussianMseReport> mse = quant::MeasureGaussianMse(n, /*seed=*/1, *codec);
    if (!mse.ok()) return ReportCommandStatus("bench-codec", mse.status());
    row.mse = *mse;
    absl::StatusOr<quant::OutputErrorReport> out = quant::MeasureOutputError(512, 512, 2048, 0.9, /*seed=*/2, *codec);
    if (!out.ok()) return ReportCommandStatus("bench-codec", out.status());
    row.out = *out;
    absl::StatusOr<quant::EncodeCostReport> cost =
        quant::MeasureEncodeCost(*codec, kTimedRows, kTimedCols, kTimedSlice, /*seed=*/3);
    if (!cost.ok()) return ReportCommandStatus("bench-codec", cost.status());
    row.cost = *cost;
  }
  if (rows.empty()) return ReportCommandStatus("bench-codec", absl::InvalidArgumentError("--codecs names no codec"));
  const quant::GaussianMseReport& ref = rows.front().mse;
  std::printf("MSE on i.i.d. N(0,1) %dx%d, identity Hessian\n", n, n);
  std::printf("| codec | 2-bit MSE | 4-bit MSE |\n| --- | ---: | ---: |\n");
  for (const Row& r : rows) std::printf("| %s | %.4f | %.5f |\n", r.codec.c_str(), r.mse.mse_2bit, r.mse.mse_4bit);
  std::printf("| round-to-nearest | %.4f | %.5f |\n", ref.rtn_mse_2bit, ref.rtn_mse_4bit);
  std::printf("| scalar Lloyd-Max | %.4f | %.5f |\n", quant::kLloydMax2Bit, quant::kLloydMax4Bit);
  std::printf("| issue #16 target | 0.0700 | 0.00450 |\n");
  std::printf("| rate-distortion bound | %.4f | %.5f |\n", quant::kRateDistortion2Bit, quant::kRateDistortion4Bit);

  std::printf("\nRelative output error ||X(W-W^)||/||XW||, 512x512 N(0,1) weights, correlated X (rho 0.9)\n");
  std::printf("| codec | bits | round-to-nearest | identity Hessian | LDLQ with H = X^T X |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf("| %s | 2 | %.4f | %.4f | %.4f |\n", r.codec.c_str(), r.out.rtn_2bit, r.out.plain_2bit, r.out.ldlq_2bit);
    std::printf("| %s | 4 | %.4f | %.4f | %.4f |\n", r.codec.c_str(), r.out.rtn_4bit, r.out.plain_4bit, r.out.ldlq_4bit);
  }

  std::printf("\nBits per weight (every scale, gain and rotation record) and CPU encode time, %lldx%lld, 1 thread, CPU seconds\n",
              static_cast<long long>(kTimedRows), static_cast<long long>(kTimedCols));
  std::printf("| codec | bits/weight at 2 | at 4 | timed slice | slice s | s per matrix (scaled) |\n");
  std::printf("| --- | ---: | ---: | --- | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.4f | %.4f | %lldx%lld | %.2f | %.1f |\n", r.codec.c_str(), r.cost.bits_2bit, r.cost.bits_4bit,
                static_cast<long long>(r.cost.slice_rows), static_cast<long long>(r.cost.cols), r.cost.slice_seconds,
                r.cost.seconds_per_matrix);
  }
  if (device_search != nullptr) {
    absl::StatusOr<double> seconds = quant::MeasureSearchedEncodeSeconds(kTimedRows, kTimedCols, *device_search, /*seed=*/3);
    if (!seconds.ok()) return ReportCommandStatus("bench-codec", seconds.status());
    std::printf("\n%s encode of a whole %lldx%lld matrix (both planes), tiles searched on %s: %.2f s wall\n",
                std::string(quant::kTrellisV1).c_str(), static_cast<long long>(kTimedRows),
                static_cast<long long>(kTimedCols), device_search->where().c_str(), *seconds);
  }
  if (const std::string models = absl::GetFlag(FLAGS_kl_models); !models.empty()) {
    std::printf("\nKL(full precision || NestQuant) over each model's tokens.json, experts from nq encode\n");
    std::printf("| model | all-2-bit KL | top-1 | all-4-bit KL | top-1 |\n| --- | ---: | ---: | ---: | ---: |\n");
    for (absl::string_view dir : absl::StrSplit(models, ',', absl::SkipEmpty())) {
      std::ifstream in(std::string(dir) + "/tokens.json");
      nlohmann::json tokens_json = nlohmann::json::parse(in, nullptr, false);
      if (tokens_json.is_discarded() || !tokens_json.contains("input_ids")) {
        return ReportCommandStatus("bench-codec", absl::InvalidArgumentError(std::string(dir) + "/tokens.json has no input_ids"));
      }
      const std::vector<int32_t> tokens = tokens_json["input_ids"].get<std::vector<int32_t>>();
      char tmp[] = "/tmp/nq-bench-release-XXXXXX";
      if (mkdtemp(tmp) == nullptr) return ReportCommandStatus("bench-codec", absl::InternalError("mkdtemp failed"));
      const std::string release = std::string(tmp) + "/release";
      absl::StatusOr<eval::KlReport> kl2 = eval::MeasureReleaseKl(std::string(dir), release, tokens, release::ExpertBits::k2Bit);
      absl::StatusOr<eval::KlReport> kl4 = eval::MeasureReleaseKl(std::string(dir), release, tokens, release::ExpertBits::k4Bit);
      std::filesystem::remove_all(tmp);
      if (!kl2.ok()) return ReportCommandStatus("bench-codec", kl2.status());
      if (!kl4.ok()) return ReportCommandStatus("bench-codec", kl4.status());
      std::printf("| %s | %.5f | %.3f | %.5f | %.3f |\n", std::string(dir).c_str(), kl2->mean_kl, kl2->top1_agreement,
                  kl4->mean_kl, kl4->top1_agreement);
    }
  }
  return 0;
}

}  // namespace nq::tools
