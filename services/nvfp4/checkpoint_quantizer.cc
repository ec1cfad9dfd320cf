#include "services/nvfp4/checkpoint_quantizer.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/dtype_convert.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"
#include "services/nvfp4/modelopt_config.h"

namespace nq::nvfp4 {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

bool MatchesAny(const std::vector<std::string>& patterns, absl::string_view name) {
  for (const std::string& p : patterns) {
    if (GlobMatch(p, name)) return true;
  }
  return false;
}

bool IsLinearWeight(const model::TensorInfo& info) {
  return absl::EndsWith(info.name, ".weight") && info.shape.size() == 2;
}

absl::StatusOr<std::string> ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Quantizes one selected tensor into `writer`.
absl::Status QuantizeTensor(const model::TensorView& view, const QuantizeCheckpointOptions& options,
                            model::SafetensorsWriter& writer, std::ofstream* tap,
                            QuantizeCheckpointSummary& summary) {
  const std::string name(view.name);
  const int64_t rows = view.shape[0], cols = view.shape[1];
  if (cols % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": input dim ", cols, " is not a multiple of 16"));
  }
  absl::StatusOr<std::vector<float>> values = model::ConvertToFloat32(view.dtype, view.data);
  if (!values.ok() || view.dtype == model::DType::kF8E4M3 || view.dtype == model::DType::kF8E5M2) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": cannot quantize a ", model::DTypeName(view.dtype),
                                                   " tensor (want F32, BF16 or F16)"));
  }
  QuantizeOptions quantize;
  quantize.search = options.search;
  quantize.threads = options.threads;
  absl::StatusOr<QuantizeResult> quantized = QuantizeNvfp4(*values, rows, cols, quantize);
  if (!quantized.ok()) return Annotate(quantized.status(), name);
  const QuantizeResult result = *std::move(quantized);
  const Nvfp4Tensor& t = result.tensor;
  auto bytes = [](const std::vector<uint8_t>& v) {
    std::vector<std::byte> out(v.size());
    std::memcpy(out.data(), v.data(), v.size());
    return out;
  };
  RETURN_IF_ERROR(writer.Add(name, model::DType::kU8, {rows, cols / 2}, bytes(t.packed)));
  RETURN_IF_ERROR(writer.Add(ScaleName(name), model::DType::kF8E4M3, {rows, cols / kBlockSize}, bytes(t.scales)));
  const float scale_2[1] = {t.scale_2};
  RETURN_IF_ERROR(writer.AddFloat32(Scale2Name(name), {}, scale_2));
  if (tap != nullptr) *tap << TapLine(name, options.search, result.stats) << "\n";
  ++summary.quantized_tensors;
  summary.quantized_weights += rows * cols;
  summary.total_sse += result.stats.mse * static_cast<double>(rows * cols);
  summary.worst_rel_error = std::max(summary.worst_rel_error, result.stats.rel_error);
  summary.clipped_blocks += result.stats.clipped_blocks;
  summary.scale_clamps += result.stats.scale_clamps;
  return absl::OkStatus();
}

}  // namespace

bool GlobMatch(absl::string_view pattern, absl::string_view text) {
  // Iterative wildcard match with one backtrack point (the last '*').
  size_t p = 0, t = 0, star = absl::string_view::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p;
      ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (star != absl::string_view::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

absl::StatusOr<QuantizeCheckpointSummary> QuantizeCheckpoint(const QuantizeCheckpointOptions& options) {
  if (options.model_dir.empty() || options.out_dir.empty()) {
    return absl::InvalidArgumentError("--model and --out are required");
  }
  if (options.include.empty()) return absl::InvalidArgumentError("no include pattern: nothing would be quantized");
  std::error_code ec;
  if (fs::exists(options.out_dir) && fs::equivalent(options.model_dir, options.out_dir, ec)) {
    return absl::InvalidArgumentError("--out must differ from --model");
  }
  const fs::path model_dir(options.model_dir), out_dir(options.out_dir);
  ASSIGN_OR_RETURN(const std::string config_text, ReadText(model_dir / "config.json"));
  Json config = Json::parse(config_text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat((model_dir / "config.json").string(), ": not a JSON object"));
  }
  if (config.contains("quantization_config")) {
    return absl::UnimplementedError(absl::StrCat(
        (model_dir / "config.json").string(),
        ": the source is already quantized (quantization_config); quantize a bf16/f16/f32 checkpoint"));
  }
  ASSIGN_OR_RETURN(model::Checkpoint source, model::Checkpoint::Open(options.model_dir));

  // Decide the selection up front from the headers: the progress total, the name collisions
  // and the config's exclude list need it before any weight is read.
  std::set<std::string> selected, names;
  std::vector<std::string> kept_modules, quantized_modules;
  for (const model::SafetensorsFile& shard : source.shards()) {
    for (const model::TensorInfo& info : shard.header().tensors) {
      names.insert(info.name);
      if (!IsLinearWeight(info)) continue;
      const std::string module = info.name.substr(0, info.name.size() - std::string_view(".weight").size());
      if (MatchesAny(options.include, info.name) && !MatchesAny(options.exclude, info.name)) {
        selected.insert(info.name);
        quantized_modules.push_back(module);
      } else {
        kept_modules.push_back(module);
      }
    }
  }
  if (selected.empty()) return absl::InvalidArgumentError("the include/exclude patterns select no linear weight");
  for (const std::string& name : selected) {
    for (const std::string& scale : {ScaleName(name), Scale2Name(name)}) {
      if (names.count(scale) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("source already has ", scale, "; is it quantized?"));
      }
    }
  }

  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create_directories(", out_dir.string(), "): ", ec.message()));
  std::ofstream tap;
  if (!options.tap_path.empty()) {
    tap.open(options.tap_path, std::ios::trunc);
    if (!tap) return absl::InternalError(absl::StrCat("cannot write ", options.tap_path));
  }

  QuantizeCheckpointSummary summary;
  Json weight_map = Json::object();
  int64_t done = 0;
  for (const model::SafetensorsFile& shard : source.shards()) {
    const std::string shard_name = fs::path(shard.path()).filename().string();
    model::SafetensorsWriter writer;
    writer.SetMetadata("format", "pt");
    for (const model::TensorInfo& info : shard.header().tensors) {
      const model::TensorView view = shard.View(info);
      if (selected.count(info.name) != 0) {
        RETURN_IF_ERROR(QuantizeTensor(view, options, writer, tap.is_open() ? &tap : nullptr, summary));
        for (const std::string& n : {info.name, ScaleName(info.name), Scale2Name(info.name)}) weight_map[n] = shard_name;
        if (options.progress) options.progress(++done, static_cast<int64_t>(selected.size()));
      } else {
        std::vector<std::byte> bytes(view.data.begin(), view.data.end());
        RETURN_IF_ERROR(writer.Add(info.name, info.dtype, info.shape, std::move(bytes)));
        weight_map[info.name] = shard_name;
        ++summary.copied_tensors;
      }
    }
    summary.output_bytes += writer.data_bytes();
    RETURN_IF_ERROR(writer.Write((out_dir / shard_name).string()));
    if (tap.is_open()) {
      tap.flush();
      if (!tap) return absl::InternalError(absl::StrCat("writing ", options.tap_path));
    }
    ++summary.shards;
  }

  const ModeloptConfig quant = BuildModeloptConfig(kept_modules, quantized_modules);
  if (source.sharded()) {
    const Json index = {{"metadata", {{"total_size", summary.output_bytes}}}, {"weight_map", weight_map}};
    RETURN_IF_ERROR(WriteTextFileAtomically((out_dir / std::string(model::Checkpoint::kIndexFileName)).string(),
                                            index.dump(2) + "\n"));
  }
  config["quantization_config"] = quant.quantization_config;
  RETURN_IF_ERROR(WriteTextFileAtomically((out_dir / "config.json").string(), config.dump(2) + "\n"));
  RETURN_IF_ERROR(WriteTextFileAtomically((out_dir / std::string(kHfQuantConfigName)).string(),
                                          quant.hf_quant_config.dump(2) + "\n"));
  // Tokenizer and generation files travel with the weights; subdirectories (eval sets,
  // reference logits) and the source's weights and index do not.
  for (const fs::directory_entry& entry : fs::directory_iterator(model_dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || absl::EndsWith(file, ".safetensors") || file == model::Checkpoint::kIndexFileName ||
        file == "config.json" || file == kHfQuantConfigName) {
      continue;
    }
    fs::copy_file(entry.path(), out_dir / file, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("copying ", entry.path().string(), ": ", ec.message()));
  }
  if (ec) return absl::InternalError(absl::StrCat("listing ", model_dir.string(), ": ", ec.message()));
  return summary;
}

}  // namespace nq::nvfp4
