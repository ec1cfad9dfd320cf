#include "services/nvfp4/modelopt_config.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "services/nvfp4/checkpoint_quantizer.h"

namespace nq::nvfp4 {
namespace {

using Json = nlohmann::json;

std::string Generalise(const std::string& module) {
  std::vector<std::string> parts = absl::StrSplit(module, '.');
  for (std::string& part : parts) {
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos) part = "*";
  }
  return absl::StrJoin(parts, ".");
}

}  // namespace

ModeloptConfig BuildModeloptConfig(const std::vector<std::string>& kept_modules,
                                   const std::vector<std::string>& quantized_modules) {
  std::map<std::string, std::vector<std::string>> by_pattern;
  for (const std::string& module : kept_modules) by_pattern[Generalise(module)].push_back(module);
  std::vector<std::string> exclude;
  for (const auto& [pattern, modules] : by_pattern) {
    bool collides = false;
    for (const std::string& q : quantized_modules) {
      if (GlobMatch(pattern, q)) {
        collides = true;
        break;
      }
    }
    if (collides) {
      exclude.insert(exclude.end(), modules.begin(), modules.end());
    } else {
      exclude.push_back(pattern);
    }
  }
  const Json producer = {{"name", std::string(kProducerName)}, {"version", "1"}};
  ModeloptConfig config;
  config.hf_quant_config = {{"producer", producer},
                            {"quantization",
                             {{"quant_algo", std::string(kQuantAlgo)},
                              {"kv_cache_quant_algo", nullptr},
                              {"group_size", 16},
                              {"exclude_modules", exclude}}}};
  config.quantization_config = {{"quant_method", "modelopt"},
                                {"quant_algo", std::string(kQuantAlgo)},
                                {"kv_cache_quant_algo", nullptr},
                                {"group_size", 16},
                                {"exclude_modules", exclude},
                                {"producer", producer}};
  return config;
}

absl::StatusOr<ModeloptInfo> ReadHfQuantConfig(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / std::string(kHfQuantConfigName)).string();
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  const Json json = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  auto invalid = [&](absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", what)); };
  if (json.is_discarded()) return invalid("malformed JSON");
  if (!json.is_object() || !json.contains("quantization") || !json["quantization"].is_object()) {
    return invalid("no \"quantization\" object");
  }
  const Json& q = json["quantization"];
  if (!q.contains("quant_algo") || !q["quant_algo"].is_string()) return invalid("quantization.quant_algo must be a string");
  if (!q.contains("group_size") || !q["group_size"].is_number_integer()) {
    return invalid("quantization.group_size must be an integer");
  }
  ModeloptInfo info;
  info.quant_algo = q["quant_algo"].get<std::string>();
  info.group_size = q["group_size"].get<int>();
  if (q.contains("exclude_modules")) {
    if (!q["exclude_modules"].is_array()) return invalid("quantization.exclude_modules must be an array");
    for (const Json& m : q["exclude_modules"]) {
      if (!m.is_string()) return invalid("quantization.exclude_modules entries must be strings");
      info.exclude_modules.push_back(m.get<std::string>());
    }
  }
  return info;
}

absl::Status WriteTextFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return absl::InternalError(absl::StrCat("writing ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("renaming ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace nq::nvfp4
