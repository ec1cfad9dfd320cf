#include "services/nvfp4/checkpoint_dequantizer.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"
#include "services/nvfp4/modelopt_config.h"
#include "services/nvfp4/nvfp4_format.h"

namespace nq::nvfp4 {
namespace {

namespace fs = std::filesystem;

}  // namespace

absl::StatusOr<DequantizeCheckpointSummary> DequantizeCheckpoint(const std::string& model_dir,
                                                                 const std::string& out_dir) {
  if (model_dir.empty() || out_dir.empty()) return absl::InvalidArgumentError("--model and --out are required");
  std::error_code ec;
  if (fs::exists(out_dir) && fs::equivalent(model_dir, out_dir, ec)) {
    return absl::InvalidArgumentError("--out must differ from --model");
  }
  ASSIGN_OR_RETURN(const model::Checkpoint source, model::Checkpoint::Open(model_dir));
  // NVFP4 weights: U8 tensors with both scale tensors beside them.
  std::set<std::string> nvfp4, dropped;
  for (const std::string& name : source.Names()) {
    if (!absl::EndsWith(name, ".weight") || !source.Contains(ScaleName(name)) || !source.Contains(Scale2Name(name))) {
      continue;
    }
    nvfp4.insert(name);
    dropped.insert(ScaleName(name));
    dropped.insert(Scale2Name(name));
    dropped.insert(absl::StrCat(name.substr(0, name.size() - std::string_view("weight").size()), "input_scale"));
  }
  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create_directories(", out_dir, "): ", ec.message()));

  DequantizeCheckpointSummary summary;
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total_bytes = 0;
  for (const model::SafetensorsFile& shard : source.shards()) {
    const std::string shard_name = fs::path(shard.path()).filename().string();
    model::SafetensorsWriter writer;
    writer.SetMetadata("format", "pt");
    for (const model::TensorInfo& info : shard.header().tensors) {
      if (dropped.count(info.name) != 0) continue;
      weight_map[info.name] = shard_name;
      if (nvfp4.count(info.name) != 0) {
        ASSIGN_OR_RETURN(const Nvfp4View view, ReadNvfp4(source, info.name));
        ASSIGN_OR_RETURN(const std::vector<float> values, Dequantize(view));
        RETURN_IF_ERROR(writer.AddFloat32(info.name, {view.rows, view.cols}, values));
        ++summary.dequantized_tensors;
      } else {
        const model::TensorView view = shard.View(info);
        RETURN_IF_ERROR(writer.Add(info.name, info.dtype, info.shape, std::vector<std::byte>(view.data.begin(), view.data.end())));
        ++summary.copied_tensors;
      }
    }
    total_bytes += writer.data_bytes();
    RETURN_IF_ERROR(writer.Write((fs::path(out_dir) / shard_name).string()));
  }
  if (source.sharded()) {
    const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    RETURN_IF_ERROR(WriteTextFileAtomically((fs::path(out_dir) / std::string(model::Checkpoint::kIndexFileName)).string(),
                                            index.dump(2) + "\n"));
  }
  for (const fs::directory_entry& entry : fs::directory_iterator(model_dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || absl::EndsWith(file, ".safetensors") ||
        file == model::Checkpoint::kIndexFileName || file == kHfQuantConfigName) {
      continue;
    }
    if (file == "config.json") {
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      nlohmann::json config = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
      if (config.is_discarded() || !config.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(entry.path().string(), ": not a JSON object"));
      }
      config.erase("quantization_config");
      RETURN_IF_ERROR(WriteTextFileAtomically((fs::path(out_dir) / file).string(), config.dump(2) + "\n"));
      continue;
    }
    fs::copy_file(entry.path(), fs::path(out_dir) / file, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("copying ", entry.path().string(), ": ", ec.message()));
  }
  return summary;
}

}  // namespace nq::nvfp4
