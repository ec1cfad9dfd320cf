#include "services/model/synth_checkpoint.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <system_error>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors_writer.h"
#include "services/model/tensor_manifest.h"

namespace nq::model {
namespace {

// Values are drawn in chunks of kChunkValues, each from its own generator seeded by (seed,
// tensor, chunk), on every core: a DeepSeek-V3 slice's 4.5 billion values took 197 s from one
// generator on a 16-core GPU machine, where the slice is built inside a timed device call. The
// values depend on the seed only, never on the thread count.
constexpr std::int64_t kChunkValues = std::int64_t{1} << 20;

float RandomValue(ExpectedTensor::Init init, float stddev, std::normal_distribution<float>& normal,
                  std::mt19937_64& rng) {
  switch (init) {
    case ExpectedTensor::Init::kLinear:
      return normal(rng) * stddev;
    case ExpectedTensor::Init::kNormWeight:
      return 1.0f + 0.1f * normal(rng);
    case ExpectedTensor::Init::kEmbedding:
      return normal(rng);
    case ExpectedTensor::Init::kZero:
      // The router's correction bias is zero in a fresh HF model; a small random one makes
      // synthetic routing exercise it.
      return 0.01f * normal(rng);
  }
  return 0.0f;
}

std::vector<float> RandomValues(const ExpectedTensor& t, std::uint64_t seed, std::uint64_t tensor_index) {
  std::int64_t n = 1;
  for (std::int64_t d : t.shape) n *= d;
  std::vector<float> values(static_cast<std::size_t>(n));
  const float stddev = t.init == ExpectedTensor::Init::kLinear ? 1.0f / std::sqrt(static_cast<float>(t.shape.back())) : 0.0f;
  const std::int64_t chunks = (n + kChunkValues - 1) / kChunkValues;
  std::atomic<std::int64_t> next{0};
  auto fill = [&] {
    for (std::int64_t c = next++; c < chunks; c = next++) {
      std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                        static_cast<std::uint32_t>(tensor_index), static_cast<std::uint32_t>(c),
                        static_cast<std::uint32_t>(c >> 32)};
      std::mt19937_64 rng(seq);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      const std::int64_t end = std::min(n, (c + 1) * kChunkValues);
      for (std::int64_t i = c * kChunkValues; i < end; ++i) values[static_cast<std::size_t>(i)] = RandomValue(t.init, stddev, normal, rng);
    }
  };
  const int threads = static_cast<int>(std::min<std::int64_t>(chunks, std::max(1u, std::thread::hardware_concurrency())));
  std::vector<std::thread> workers;
  for (int i = 1; i < threads; ++i) {
    // A thread the system cannot start leaves its chunks to the others (the values do not depend
    // on who draws them); std::thread reports that as an exception, which stays here.
    try {
      workers.emplace_back(fill);
    } catch (const std::system_error&) {
      break;
    }
  }
  fill();
  for (std::thread& worker : workers) worker.join();
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

  SafetensorsWriter writer;
  std::uint64_t tensor_index = 0;
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    ++tensor_index;  // counted whether or not written, so a tensor's values do not depend on the options
    if (!options.routed_experts && absl::StrContains(t.name, ".mlp.experts.")) continue;
    std::vector<float> values = RandomValues(t, options.seed, tensor_index);
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
