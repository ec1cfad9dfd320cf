// nq synth-model: a random-weight checkpoint in the hub layout for a config.json.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "services/common/status_macros.h"
#include "services/model/model_config.h"
#include "services/model/synth_checkpoint.h"
#include "services/tools/commands.h"

ABSL_FLAG(std::string, config, "", "synth-model: config.json to build the checkpoint for");
ABSL_FLAG(std::string, dtype, "f32", "synth-model: f32, bf16 or fp8 (F8_E4M3 with 128x128 block scales)");
ABSL_FLAG(uint64_t, seed, 0,
          "synth-model, synth-release: random seed; bench-decode: seed of the prompt's token ids");
ABSL_FLAG(uint64_t, max_shard_mb, 0, "synth-model: shard the weights into files of at most this many MiB");
ABSL_FLAG(bool, routed_experts, true,
          "synth-model: write the routed experts' weights (false: leave them to a release, nq synth-release)");

namespace nq::tools {
namespace {

absl::Status Run() {
  const std::string config_path = absl::GetFlag(FLAGS_config), out = absl::GetFlag(FLAGS_out);
  if (config_path.empty() || out.empty()) return absl::InvalidArgumentError("--config and --out are required");
  std::ifstream in(config_path);
  if (!in) return absl::NotFoundError("cannot read " + config_path);
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<model::ModelConfig> config = model::ParseModelConfig(text.str());
  if (!config.ok()) return Annotate(config.status(), config_path);
  model::SynthOptions options;
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "f32") {
    options.dtype = model::SynthDtype::kF32;
  } else if (dtype == "bf16") {
    options.dtype = model::SynthDtype::kBF16;
  } else if (dtype == "fp8") {
    options.dtype = model::SynthDtype::kFp8;
  } else {
    return absl::InvalidArgumentError("--dtype: want f32, bf16 or fp8, got '" + dtype + "'");
  }
  options.seed = absl::GetFlag(FLAGS_seed);
  options.max_shard_bytes = absl::GetFlag(FLAGS_max_shard_mb) << 20;
  options.routed_experts = absl::GetFlag(FLAGS_routed_experts);
  RETURN_IF_ERROR(model::WriteSyntheticCheckpoint(*std::move(config), out, options));
  std::fprintf(stderr, "nq synth-model: wrote %s\n", out.c_str());
  return absl::OkStatus();
}

}  // namespace

int RunSynthModel(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "nq synth-model: unexpected argument '%s'\n", args[0].c_str());
    return 2;
  }
  if (absl::Status s = Run(); !s.ok()) {
    std::fprintf(stderr, "nq synth-model: %s\n", s.ToString().c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace nq::tools
