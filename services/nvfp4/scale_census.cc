#include "services/nvfp4/scale_census.h"

#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/nvfp4/nvfp4_format.h"

namespace nq::nvfp4 {
namespace {

struct ExpertScaleKey {
  int64_t layer;
  int64_t expert;
  bool gate;
};

// "model.layers.L.mlp.experts.E.{gate,up}_proj.weight_scale_2" -> (L, E, gate?).
std::optional<ExpertScaleKey> ParseScaleName(absl::string_view name) {
  const std::vector<absl::string_view> parts = absl::StrSplit(name, '.');
  if (parts.size() != 8 || parts[0] != "model" || parts[1] != "layers" || parts[3] != "mlp" ||
      parts[4] != "experts" || parts[7] != "weight_scale_2" || (parts[6] != "gate_proj" && parts[6] != "up_proj")) {
    return std::nullopt;
  }
  ExpertScaleKey parsed{0, 0, parts[6] == "gate_proj"};
  if (!absl::SimpleAtoi(parts[2], &parsed.layer) || !absl::SimpleAtoi(parts[5], &parsed.expert) ||
      parsed.layer < 0 || parsed.expert < 0) {
    return std::nullopt;
  }
  return parsed;
}

// How far a ratio is from 1, symmetric in up/gate and gate/up.
double Distance(double ratio) { return std::fabs(std::log(ratio)); }

}  // namespace

absl::StatusOr<CensusReport> RunCensus(const std::string& model_dir) {
  ASSIGN_OR_RETURN(const model::Checkpoint checkpoint, model::Checkpoint::Open(model_dir));
  // (layer, expert) -> (gate, up); only the header and the scalars are read.
  std::map<std::pair<int64_t, int64_t>, std::pair<std::optional<float>, std::optional<float>>> pairs;
  for (const model::SafetensorsFile& shard : checkpoint.shards()) {
    for (const model::TensorInfo& info : shard.header().tensors) {
      const std::optional<ExpertScaleKey> parsed = ParseScaleName(info.name);
      if (!parsed.has_value()) continue;
      ASSIGN_OR_RETURN(const float value, ReadScalarScale(shard.View(info)));
      auto& pair = pairs[{parsed->layer, parsed->expert}];
      (parsed->gate ? pair.first : pair.second) = value;
    }
  }
  if (pairs.empty()) {
    return absl::NotFoundError(absl::StrCat(model_dir, ": no model.layers.L.mlp.experts.E.{gate,up}_proj.weight_scale_2",
                                            " (not an NVFP4 checkpoint with routed experts?)"));
  }
  CensusReport report;
  std::map<int64_t, LayerCensus> layers;
  for (const auto& [key, scales] : pairs) {
    const std::string prefix = absl::StrCat("model.layers.", key.first, ".mlp.experts.", key.second, ".");
    if (!scales.first.has_value() || !scales.second.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, scales.first.has_value() ? "gate_proj" : "up_proj",
                                                     ".weight_scale_2 has no ",
                                                     scales.first.has_value() ? "up_proj" : "gate_proj",
                                                     " counterpart"));
    }
    ExpertScalePair entry{key.first, key.second, *scales.first, *scales.second,
                          static_cast<double>(*scales.second) / static_cast<double>(*scales.first)};
    report.experts.push_back(entry);
    LayerCensus& layer = layers[key.first];
    layer.layer = key.first;
    ++layer.experts;
    if (entry.gate_scale_2 != entry.up_scale_2) {
      report.mismatched.push_back(entry);
      ++layer.mismatched;
    }
    if (Distance(entry.ratio) > Distance(layer.worst_ratio)) layer.worst_ratio = entry.ratio;
    if (Distance(entry.ratio) > Distance(report.worst_ratio)) report.worst_ratio = entry.ratio;
  }
  for (const auto& [index, layer] : layers) report.layers.push_back(layer);
  return report;
}

nlohmann::json CensusJson(const CensusReport& report) {
  nlohmann::json layers = nlohmann::json::array(), mismatched = nlohmann::json::array();
  for (const LayerCensus& l : report.layers) {
    layers.push_back({{"layer", l.layer}, {"experts", l.experts}, {"mismatched", l.mismatched},
                      {"worst_ratio", l.worst_ratio}});
  }
  for (const ExpertScalePair& e : report.mismatched) {
    mismatched.push_back({{"layer", e.layer}, {"expert", e.expert}, {"gate_scale_2", e.gate_scale_2},
                          {"up_scale_2", e.up_scale_2}, {"ratio", e.ratio}});
  }
  return {{"experts", report.experts.size()},
          {"mismatched_count", report.mismatched.size()},
          {"worst_ratio", report.worst_ratio},
          {"layers", layers},
          {"mismatched", mismatched}};
}

std::string CensusText(const CensusReport& report) {
  std::string out = absl::StrFormat("%-6s %8s %11s %12s\n", "layer", "experts", "mismatched", "worst up/gate");
  for (const LayerCensus& l : report.layers) {
    absl::StrAppendFormat(&out, "%-6d %8d %11d %12.4g\n", l.layer, l.experts, l.mismatched, l.worst_ratio);
  }
  absl::StrAppendFormat(&out, "total: %d experts, %d with gate/up weight_scale_2 mismatched, worst ratio %.4g\n",
                        report.experts.size(), report.mismatched.size(), report.worst_ratio);
  return out;
}

}  // namespace nq::nvfp4
