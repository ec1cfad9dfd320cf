// manifest.json of a NestQuant release (DESIGN.md section 5): what the release encodes and
// how, shared by every rank. Written by nq encode / nq assemble, read by the streamer and
// workers, which refuse a release whose manifest does not match the model they serve.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::format {

inline constexpr char kFormatName[] = "nestquant";
// Bumped on any incompatible change of the files' layout or meaning. Version 2 added the
// per-record sha256 to the rank indexes (issue #22): every record read is checked before it
// can become READY.
inline constexpr uint32_t kFormatVersion = 2;
// Version 3 is version 2 plus low-rank corrections of the experts (issue #16): resident factors
// per corrected expert matrix and a factor segment per projection in the records, announced by
// codec.params.lowrank (kLowRankParam). Only a release that carries them is written as version 3,
// so one without stays byte-identical to version 2, and a build that predates them refuses it by
// its version instead of serving the experts without their corrections. Rank indexes stay at
// kFormatVersion: their layout did not change.
inline constexpr uint32_t kLowRankFormatVersion = 3;
inline constexpr char kLowRankParam[] = "lowrank";

// The error for a release of another format version; says what to do about an older one
// (`file` is the file that carries the version, e.g. "manifest.json").
std::string UnsupportedVersionMessage(const std::string& file, uint32_t version);

inline constexpr char kManifestFile[] = "manifest.json";

struct LayerRotation {
  uint32_t hadamard_width = 0;  // a power of two (128, or e.g. 512 on down_proj)
  uint64_t sign_seed = 0;

  bool operator==(const LayerRotation&) const = default;
};

struct ManifestLayer {
  uint32_t layer = 0;  // model layer id
  LayerRotation rotation;
  std::vector<uint32_t> fixed_4bit;  // default experts pinned at 4 bits, distinct
  std::vector<uint32_t> ranking;     // every expert once, most valuable first

  bool operator==(const ManifestLayer&) const = default;
};

struct Manifest {
  std::string format = kFormatName;
  uint32_t version = kFormatVersion;
  std::string source_model;  // e.g. "zai-org/GLM-5"
  std::string config_hash;   // sha256 of the source config.json
  uint32_t tp_size = 0;
  uint32_t experts_per_layer = 0;
  std::string codec;                                       // e.g. "scalar-nested"
  nlohmann::json codec_params = nlohmann::json::object();  // the codec's own parameters
  std::vector<ManifestLayer> layers;                       // MoE layers, strictly increasing ids

  // INVALID_ARGUMENT naming the first broken rule (format name and version, non-empty
  // identity fields, tp_size and experts_per_layer positive, layers increasing, Hadamard
  // widths powers of two, fixed sets distinct and in range, rankings permutations).
  absl::Status Validate() const;
  std::vector<uint32_t> LayerIds() const;
  // The entry for model layer `layer`, or nullptr.
  const ManifestLayer* FindLayer(uint32_t layer) const;

  bool operator==(const Manifest&) const = default;
};

// Deterministic text (sorted keys, 2-space indent, trailing newline): the same manifest
// always serializes to the same bytes, so rewriting it is a no-op on disk.
std::string SerializeManifest(const Manifest& manifest);
// Parses and validates; errors name manifest.json and the field.
absl::StatusOr<Manifest> ParseManifest(const std::string& text);
absl::StatusOr<Manifest> ReadManifest(const std::string& release_dir);

// What a serving model expects of a release.
struct ModelIdentity {
  std::string config_hash;
  uint32_t tp_size = 0;
  std::vector<uint32_t> moe_layer_ids;
  uint32_t experts_per_layer = 0;
};

// FAILED_PRECONDITION listing every field where `manifest` differs from `model`.
absl::Status CheckManifestMatchesModel(const Manifest& manifest, const ModelIdentity& model);

}  // namespace nq::format
