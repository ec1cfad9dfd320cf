// nq nvfp4 quantize | dequantize | repack-error, nq census: the NVFP4 checkpoint tools (services/nvfp4).
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "services/nvfp4/checkpoint_dequantizer.h"
#include "services/nvfp4/checkpoint_quantizer.h"
#include "services/nvfp4/repack_measure.h"
#include "services/nvfp4/scale_census.h"
#include "services/tools/commands.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int, tp);
ABSL_FLAG(std::string, scale_search, "nonclip",
          "nvfp4 quantize: off (stock ModelOpt recipe), nonclip (block scales 1.0-1.75x, never clips) or clip "
          "(0.70-1.75x, for measurement)");
ABSL_FLAG(std::string, tap, "", "nvfp4 quantize: write one JSON line of error statistics per quantized tensor here");
ABSL_FLAG(std::string, include, "",
          "nvfp4 quantize: comma-separated glob patterns of linear weights to quantize (default: routed experts, "
          "model.layers.*.mlp.experts.*.*_proj.weight)");
ABSL_FLAG(std::string, exclude, "", "nvfp4 quantize: comma-separated glob patterns of weights to leave as they are");
ABSL_FLAG(int, threads, 2, "nvfp4 quantize: threads per tensor");
ABSL_FLAG(bool, json, false, "census: print one JSON object instead of the table");
ABSL_FLAG(std::string, reference, "", "nvfp4 repack-error: the unquantized checkpoint the NVFP4 one was made from");

namespace nq::tools {
namespace {

std::vector<std::string> Patterns(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipWhitespace());
}

void TensorProgress(int64_t done, int64_t total) {
  if (!isatty(STDERR_FILENO)) return;
  const int width = 40;
  const int filled = total > 0 ? static_cast<int>(done * width / total) : width;
  std::fprintf(stderr, "\r[%s%s] %ld/%ld tensors", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), static_cast<long>(done), static_cast<long>(total));
  if (done == total) std::fprintf(stderr, "\n");
}

int RunQuantize() {
  nvfp4::QuantizeCheckpointOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.out_dir = absl::GetFlag(FLAGS_out);
  absl::StatusOr<nvfp4::ScaleSearch> search = nvfp4::ParseScaleSearch(absl::GetFlag(FLAGS_scale_search));
  if (!search.ok()) return ReportCommandStatus("nvfp4 quantize", search.status());
  options.search = *search;
  if (!absl::GetFlag(FLAGS_include).empty()) options.include = Patterns(absl::GetFlag(FLAGS_include));
  options.exclude = Patterns(absl::GetFlag(FLAGS_exclude));
  options.tap_path = absl::GetFlag(FLAGS_tap);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.progress = TensorProgress;
  absl::StatusOr<nvfp4::QuantizeCheckpointSummary> summary = nvfp4::QuantizeCheckpoint(options);
  if (!summary.ok()) return ReportCommandStatus("nvfp4 quantize", summary.status());
  std::printf("quantized %ld tensors (%ld weights, scale search %s), copied %ld, %d shard(s) -> %s\n",
              static_cast<long>(summary->quantized_tensors), static_cast<long>(summary->quantized_weights),
              std::string(nvfp4::ScaleSearchName(options.search)).c_str(), static_cast<long>(summary->copied_tensors),
              summary->shards, options.out_dir.c_str());
  std::printf("weight MSE %.6e, worst relative error %.4f, clipped blocks %ld, scale clamps %ld\n",
              summary->quantized_weights > 0 ? summary->total_sse / summary->quantized_weights : 0.0,
              summary->worst_rel_error, static_cast<long>(summary->clipped_blocks),
              static_cast<long>(summary->scale_clamps));
  return 0;
}

int RunRepackError() {
  nvfp4::RepackMeasureOptions options;
  options.nvfp4_dir = absl::GetFlag(FLAGS_model);
  options.reference_dir = absl::GetFlag(FLAGS_reference);
  options.tp_size = absl::GetFlag(FLAGS_tp);
  if (options.nvfp4_dir.empty() || options.reference_dir.empty()) {
    return ReportCommandStatus("nvfp4 repack-error", absl::InvalidArgumentError("--model and --reference are required"));
  }
  absl::StatusOr<nvfp4::RepackMeasurement> m = nvfp4::MeasureRepackError(options);
  if (!m.ok()) return ReportCommandStatus("nvfp4 repack-error", m.status());
  std::printf("%ld of %ld experts have gate/up weight_scale_2 mismatched (worst up/gate %.4g); tp %d\n",
              static_cast<long>(m->measured_experts), static_cast<long>(m->experts), m->worst_ratio, options.tp_size);
  std::printf("%-22s %14s %14s %12s\n", "fused gate/up", "gate MSE", "up MSE", "up / matched");
  std::printf("%-22s %14.6e %14.6e %12.4f\n", "unfused (own globals)", m->unfused_gate_mse, m->unfused_up_mse,
              m->unfused_up_mse / m->matched_up_mse);
  std::printf("%-22s %14.6e %14.6e %12.4f\n", "matched (requantized)", m->matched_gate_mse, m->matched_up_mse, 1.0);
  for (const nvfp4::RepackModeError& e : m->modes) {
    std::printf("%-22s %14.6e %14.6e %12.4f\n", std::string(nvfp4::GateUpScaleModeName(e.mode)).c_str(), e.gate_mse,
                e.up_mse, e.up_mse / m->matched_up_mse);
  }
  return 0;
}

int RunDequantize() {
  const std::string model = absl::GetFlag(FLAGS_model), out = absl::GetFlag(FLAGS_out);
  absl::StatusOr<nvfp4::DequantizeCheckpointSummary> summary = nvfp4::DequantizeCheckpoint(model, out);
  if (!summary.ok()) return ReportCommandStatus("nvfp4 dequantize", summary.status());
  std::printf("dequantized %ld NVFP4 tensors to F32, copied %ld -> %s\n", static_cast<long>(summary->dequantized_tensors),
              static_cast<long>(summary->copied_tensors), out.c_str());
  return 0;
}

}  // namespace

int RunNvfp4(const std::vector<std::string>& args) {
  const std::string sub = args.size() == 1 ? args[0] : "";
  if (sub == "quantize") return RunQuantize();
  if (sub == "dequantize") return RunDequantize();
  if (sub == "repack-error") return RunRepackError();
  return ReportCommandStatus("nvfp4", absl::InvalidArgumentError("want 'nq nvfp4 quantize|dequantize|repack-error'"));
}

int RunCensus(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("census", absl::InvalidArgumentError("unexpected argument " + args[0]));
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) return ReportCommandStatus("census", absl::InvalidArgumentError("--model is required"));
  absl::StatusOr<nvfp4::CensusReport> report = nvfp4::RunCensus(model);
  if (!report.ok()) return ReportCommandStatus("census", report.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", nvfp4::CensusJson(*report).dump(2).c_str());
  } else {
    std::printf("%s", nvfp4::CensusText(*report).c_str());
  }
  return 0;
}

}  // namespace nq::tools
