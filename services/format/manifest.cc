#include "services/format/manifest.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/format/json_fields.h"

namespace nq::format {
namespace {

namespace jf = json_fields;
using Json = nlohmann::json;

absl::StatusOr<std::vector<uint32_t>> UintList(const Json& obj, const std::string& key,
                                               const std::string& where) {
  ASSIGN_OR_RETURN(const Json* array, jf::Array(obj, key, where));
  std::vector<uint32_t> out;
  for (size_t i = 0; i < array->size(); ++i) {
    const Json& v = (*array)[i];
    if (!v.is_number_unsigned() || v.get<uint64_t>() > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", key, "[", i, "] must be a non-negative integer"));
    }
    out.push_back(v.get<uint32_t>());
  }
  return out;
}

absl::Status ValidateLayer(const ManifestLayer& l, uint32_t experts) {
  const std::string where = absl::StrCat("manifest.json: layer ", l.layer);
  const uint32_t w = l.rotation.hadamard_width;
  if (w == 0 || (w & (w - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": hadamard_width ", w, " is not a power of two"));
  }
  std::vector<bool> seen(experts, false);
  for (uint32_t e : l.fixed_4bit) {
    if (e >= experts) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": fixed_4bit expert ", e, " is out of range [0, ", experts, ")"));
    }
    if (seen[e]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": fixed_4bit lists expert ", e, " twice"));
    }
    seen[e] = true;
  }
  if (l.ranking.size() != experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ranking has ", l.ranking.size(), " experts, expected ", experts));
  }
  std::vector<bool> ranked(experts, false);
  for (uint32_t e : l.ranking) {
    if (e >= experts || ranked[e]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ranking is not a permutation of the experts (", e, ")"));
    }
    ranked[e] = true;
  }
  return absl::OkStatus();
}

}  // namespace

std::string UnsupportedVersionMessage(const std::string& file, uint32_t version) {
  // Only manifests carry version 3 (rank indexes did not change with it).
  std::string message = absl::StrCat(file, ": format version ", version, " is not supported (this build reads ",
                                     kFormatVersion,
                                     file == kManifestFile ? absl::StrCat(" and ", kLowRankFormatVersion) : "", ")");
  // Version 1 releases have no per-record checksums, and serving them would hand out records
  // no one checked since the file was hashed once: re-encoding is the way forward.
  if (version < kFormatVersion) {
    absl::StrAppend(&message, "; version ", version,
                    " releases lack the per-record sha256 this build checks every read against:"
                    " re-encode the release with `nq encode` into an empty directory");
  }
  return message;
}

absl::Status Manifest::Validate() const {
  if (format != kFormatName) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest.json: format is '", format, "', expected '", kFormatName, "'"));
  }
  if (version != kFormatVersion && version != kLowRankFormatVersion) {
    return absl::InvalidArgumentError(UnsupportedVersionMessage("manifest.json", version));
  }
  if (source_model.empty())
    return absl::InvalidArgumentError("manifest.json: source_model is empty");
  if (config_hash.empty()) return absl::InvalidArgumentError("manifest.json: config_hash is empty");
  if (codec.empty()) return absl::InvalidArgumentError("manifest.json: codec.name is empty");
  if (!codec_params.is_object()) {
    return absl::InvalidArgumentError("manifest.json: codec.params must be an object");
  }
  // Corrections and version 3 go together: a version 2 reader must never meet them.
  const bool lowrank = codec_params.contains(kLowRankParam);
  if (lowrank != (version == kLowRankFormatVersion)) {
    return absl::InvalidArgumentError(absl::StrCat("manifest.json: version ", version, lowrank ? " has" : " lacks",
                                                   " codec.params.", kLowRankParam, " (version ", kLowRankFormatVersion,
                                                   " exactly when the experts carry low-rank corrections)"));
  }
  if (tp_size == 0) return absl::InvalidArgumentError("manifest.json: tp_size must be positive");
  if (experts_per_layer == 0) {
    return absl::InvalidArgumentError("manifest.json: experts_per_layer must be positive");
  }
  if (layers.empty()) return absl::InvalidArgumentError("manifest.json: layers is empty");
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0 && layers[i].layer <= layers[i - 1].layer) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest.json: layer ids must be strictly increasing (",
                       layers[i - 1].layer, " then ", layers[i].layer, ")"));
    }
    RETURN_IF_ERROR(ValidateLayer(layers[i], experts_per_layer));
  }
  return absl::OkStatus();
}

std::vector<uint32_t> Manifest::LayerIds() const {
  std::vector<uint32_t> ids;
  for (const ManifestLayer& l : layers) ids.push_back(l.layer);
  return ids;
}

const ManifestLayer* Manifest::FindLayer(uint32_t layer) const {
  for (const ManifestLayer& l : layers) {
    if (l.layer == layer) return &l;
  }
  return nullptr;
}

std::string SerializeManifest(const Manifest& m) {
  Json layers = Json::array();
  for (const ManifestLayer& l : m.layers) {
    layers.push_back(
        {{"layer", l.layer},
         {"rotation",
          {{"hadamard_width", l.rotation.hadamard_width}, {"sign_seed", l.rotation.sign_seed}}},
         {"fixed_4bit", l.fixed_4bit},
         {"ranking", l.ranking}});
  }
  Json json = {{"format", m.format},
               {"version", m.version},
               {"source_model", m.source_model},
               {"config_hash", m.config_hash},
               {"tp_size", m.tp_size},
               {"experts_per_layer", m.experts_per_layer},
               {"codec", {{"name", m.codec}, {"params", m.codec_params}}},
               {"layers", std::move(layers)}};
  return json.dump(2) + "\n";
}

absl::StatusOr<Manifest> ParseManifest(const std::string& text) {
  const std::string file = kManifestFile;
  ASSIGN_OR_RETURN(Json json, jf::Parse(text, file));
  Manifest m;
  // Format and version first: a newer release gets a version error, not a field error.
  ASSIGN_OR_RETURN(m.format, jf::String(json, "format", file));
  ASSIGN_OR_RETURN(m.version, jf::Uint32(json, "version", file));
  if (m.format != kFormatName || (m.version != kFormatVersion && m.version != kLowRankFormatVersion)) {
    RETURN_IF_ERROR(m.Validate());
  }
  ASSIGN_OR_RETURN(m.source_model, jf::String(json, "source_model", file));
  ASSIGN_OR_RETURN(m.config_hash, jf::String(json, "config_hash", file));
  ASSIGN_OR_RETURN(m.tp_size, jf::Uint32(json, "tp_size", file));
  ASSIGN_OR_RETURN(m.experts_per_layer, jf::Uint32(json, "experts_per_layer", file));
  ASSIGN_OR_RETURN(const Json* codec, jf::Object(json, "codec", file));
  ASSIGN_OR_RETURN(m.codec, jf::String(*codec, "name", file + ": codec"));
  ASSIGN_OR_RETURN(const Json* params, jf::Object(*codec, "params", file + ": codec"));
  m.codec_params = *params;
  ASSIGN_OR_RETURN(const Json* layers, jf::Array(json, "layers", file));
  for (size_t i = 0; i < layers->size(); ++i) {
    const std::string at = absl::StrCat(file, ": layers[", i, "]");
    const Json& lj = (*layers)[i];
    ManifestLayer l;
    ASSIGN_OR_RETURN(l.layer, jf::Uint32(lj, "layer", at));
    ASSIGN_OR_RETURN(const Json* rot, jf::Object(lj, "rotation", at));
    ASSIGN_OR_RETURN(l.rotation.hadamard_width,
                     jf::Uint32(*rot, "hadamard_width", at + ".rotation"));
    ASSIGN_OR_RETURN(l.rotation.sign_seed, jf::Uint(*rot, "sign_seed", at + ".rotation"));
    ASSIGN_OR_RETURN(l.fixed_4bit, UintList(lj, "fixed_4bit", at));
    ASSIGN_OR_RETURN(l.ranking, UintList(lj, "ranking", at));
    m.layers.push_back(std::move(l));
  }
  RETURN_IF_ERROR(m.Validate());
  return m;
}

absl::StatusOr<Manifest> ReadManifest(const std::string& release_dir) {
  const std::string path = (std::filesystem::path(release_dir) / kManifestFile).string();
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseManifest(text);
}

absl::Status CheckManifestMatchesModel(const Manifest& manifest, const ModelIdentity& model) {
  std::vector<std::string> diffs;
  if (manifest.config_hash != model.config_hash) {
    diffs.push_back(absl::StrCat("config hash ", manifest.config_hash, " (release) vs ",
                                 model.config_hash, " (model)"));
  }
  if (manifest.tp_size != model.tp_size) {
    diffs.push_back(
        absl::StrCat("tp_size ", manifest.tp_size, " (release) vs ", model.tp_size, " (model)"));
  }
  if (manifest.experts_per_layer != model.experts_per_layer) {
    diffs.push_back(absl::StrCat("experts per layer ", manifest.experts_per_layer, " (release) vs ",
                                 model.experts_per_layer, " (model)"));
  }
  if (manifest.LayerIds() != model.moe_layer_ids) {
    diffs.push_back(absl::StrCat("MoE layers [", absl::StrJoin(manifest.LayerIds(), ","),
                                 "] (release) vs [", absl::StrJoin(model.moe_layer_ids, ","),
                                 "] (model)"));
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the release (", manifest.source_model,
                   ") does not match the model: ", absl::StrJoin(diffs, "; ")));
}

}  // namespace nq::format
