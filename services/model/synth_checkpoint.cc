#include "services/model/synth_checkpoint.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors_writer.h"
#include "services/model/tensor_manifest.h"

namespace nq::model {
namespace {

std::vector<float> RandomValues(const ExpectedTensor& t, std::mt19937_64& rng) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  switch (t.init) {
    case ExpectedTensor::Init::kLinear: {
      const float stddev = 1.0f / std::sqrt(static_cast<float>(t.shape.back()));
      for (float& v : values) v = normal(rng) * stddev;
      break;
    }
    case ExpectedTensor::Init::kNormWeight:
      for (float& v : values) v = 1.0f + 0.1f * normal(rng);
      break;
    case ExpectedTensor::Init::kEmbedding:
      for (float& v : values) v = normal(rng);
      break;
    case ExpectedTensor::Init::kZero:
      // The router's correction bias is zero in a fresh HF model; a small random one makes
      // synthetic routing exercise it.
      for (float& v : values) v = 0.01f * normal(rng);
      break;
  }
  return values;
}

absl::Status WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path.string()));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSyntheticCheckpoint(ModelConfig config, const std::string& out_dir,
                                      const SynthOptions& options) {
  if (options.dtype == SynthDtype::kFp8) {
    config.quantization = QuantizationConfig{};
  } else {
    config.quantization.reset();
  }
  config.dtype = options.dtype == SynthDtype::kF32 ? "float32" : "bfloat16";
  RETURN_IF_ERROR(config.Validate());
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));

  std::mt19937_64 rng(options.seed);
  SafetensorsWriter writer;
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    if (!options.routed_experts && absl::StrContains(t.name, ".mlp.experts.")) continue;
    std::vector<float> values = RandomValues(t, rng);
    const bool is_bias = t.name.ends_with("e_score_correction_bias");
    if (options.dtype == SynthDtype::kFp8 && t.fp8_eligible && t.shape.size() == 2) {
      RETURN_IF_ERROR(writer.AddFp8BlockQuantized(t.name, t.shape[0], t.shape[1], values));
    } else if (options.dtype == SynthDtype::kF32 || is_bias) {
      RETURN_IF_ERROR(writer.AddFloat32(t.name, t.shape, values, DType::kF32));
    } else {
      RETURN_IF_ERROR(writer.AddFloat32(t.name, t.shape, values, DType::kBF16));
    }
  }
  writer.SetMetadata("format", "pt");
  RETURN_IF_ERROR(writer.WriteCheckpoint(out_dir, options.max_shard_bytes));

  const std::filesystem::path dir(out_dir);
  RETURN_IF_ERROR(WriteText(dir / "config.json", config.ToJson()));
  nlohmann::json generation = {{"_from_model_config", true}};
  if (config.bos_token_id.has_value()) generation["bos_token_id"] = *config.bos_token_id;
  if (config.eos_token_ids.size() == 1) {
    generation["eos_token_id"] = config.eos_token_ids[0];
  } else if (!config.eos_token_ids.empty()) {
    generation["eos_token_id"] = config.eos_token_ids;
  }
  return WriteText(dir / "generation_config.json", generation.dump(2) + "\n");
}

}  // namespace nq::model
