#include "services/release/release_encoder.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/format/release_reader.h"
#include "services/format/release_writer.h"
#include "services/model/model_config.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_load.h"
#include "services/model/safetensors_writer.h"
#include "services/quant/codec.h"
#include "services/quant/nested_scalar_codec.h"
#include "services/quant/trellis_codec.h"
#include "services/quant/trellis_decode.h"
#include "services/release/calibration.h"
#include "services/release/low_rank_io.h"
#include "services/release/ordered_work.h"

namespace nq::release {
namespace {

constexpr const char* kProjections[] = {"gate_proj", "up_proj", "down_proj"};
constexpr size_t kNumProjections = std::size(kProjections);

// An expert's three encoded matrices and their low-rank fits (empty corrections without), in
// kProjections' order.
struct ExpertMatrices {
  std::array<quant::EncodedMatrix, kNumProjections> matrices;
  std::array<quant::CorrectionFit, kNumProjections> fits;
};
// One matrix as the encoder hands it on.
struct EncodedExpertMatrix {
  quant::EncodedMatrix matrix;
  quant::CorrectionFit fit;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The widest power-of-two block up to `widest` (128, or 512 for down_proj's input, whose
// low-rank statistics a wider block spreads further: DESIGN.md section 6) that divides n.
int64_t HadamardBlock(int64_t n, int64_t widest) {
  for (int64_t b = widest; b >= quant::kMinHadamardBlock; b /= 2) {
    if (n % b == 0) return b;
  }
  return 0;
}

// This rank's slice of one expert matrix: gate/up split their rows (output), down its
// columns (input), as the model's tensor-parallel plan does.
std::vector<float> Slice(const model::FloatTensor& t, bool split_rows, int rank, int world) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  if (split_rows) {
    const int64_t r = rows / world;
    return std::vector<float>(t.values.begin() + rank * r * cols, t.values.begin() + (rank + 1) * r * cols);
  }
  const int64_t c = cols / world;
  std::vector<float> out;
  out.reserve(static_cast<size_t>(rows * c));
  for (int64_t i = 0; i < rows; ++i) {
    out.insert(out.end(), t.values.begin() + i * cols + rank * c, t.values.begin() + i * cols + (rank + 1) * c);
  }
  return out;
}

std::vector<std::byte> Bytes(std::span<const uint8_t> data) {
  std::vector<std::byte> out(data.size());
  std::memcpy(out.data(), data.data(), data.size());
  return out;
}


// An expert matrix of a synthetic release, which the seed and these name.
struct SyntheticExpert {
  uint32_t layer, rank, expert;
  const char* projection;
};

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A stable key for (seed, words...): the same release whatever the platform (std::hash is not).
uint64_t MixKey(uint64_t seed, std::initializer_list<uint64_t> words) {
  uint64_t state = seed;
  uint64_t key = SplitMix64(state);
  for (uint64_t w : words) {
    state ^= w + 0x632be59bd9b4e019ull;
    key ^= SplitMix64(state);
  }
  return key;
}

uint64_t ProjectionIndex(const std::string& projection) {
  for (uint64_t i = 0; i < std::size(kProjections); ++i) {
    if (projection == kProjections[i]) return i;
  }
  return std::size(kProjections);
}

// The projection's template (one random N(0, 1/cols) matrix encoded at the real shape: real scales
// and codebooks), then this expert's own random codes and the layer's rotation seeds.
absl::StatusOr<quant::EncodedMatrix> SyntheticMatrix(const quant::Codec& codec, int64_t rows, int64_t cols,
                                                     const quant::EncodeOptions& encode, uint64_t seed,
                                                     const SyntheticExpert& id,
                                                     std::map<std::string, quant::EncodedMatrix>& templates) {
  const uint64_t projection = ProjectionIndex(id.projection);
  auto it = templates.find(id.projection);
  if (it == templates.end()) {
    std::mt19937_64 rng(MixKey(seed, {projection}));
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    std::vector<float> w(static_cast<size_t>(rows * cols));
    for (float& v : w) v = normal(rng);
    ASSIGN_OR_RETURN(quant::EncodedMatrix t, codec.Encode(w, rows, cols, nullptr, encode));
    it = templates.emplace(id.projection, std::move(t)).first;
  }
  quant::EncodedMatrix m = it->second;
  m.params.rotation = encode.rotation;
  if (codec.name() == quant::kTrellisV1) return m;  // random bits are no Viterbi path: keep the encoded ones
  const int64_t weights = rows * cols;
  if (static_cast<int64_t>(m.base_codes.size()) != quant::PlaneBytes(rows, cols, 2) ||
      static_cast<int64_t>(m.residual_codes.size()) != quant::PlaneBytes(rows, cols, 2)) {
    return absl::InternalError(absl::StrCat("synthetic release: ", codec.name(),
                                            " planes are not 2-bit code planes of ", rows, " x ", cols));
  }
  const uint64_t key = MixKey(seed, {id.layer, id.rank, id.expert, projection});
  FillRandomCodes(m.base_codes, 2 * weights, key);
  FillRandomCodes(m.residual_codes, 2 * weights, ~key);
  return m;
}

}  // namespace

int DefaultRefinements(absl::string_view codec_name, bool calibrated) {
  return codec_name == quant::kNestedScalarV1 && calibrated ? 1 : 0;
}

absl::Status EncodeRelease(const std::string& model_dir, const std::string& out_dir,
                           const EncodeReleaseOptions& options) {
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(model_dir + "/config.json"));
  ASSIGN_OR_RETURN(model::ModelConfig config, model::ParseModelConfig(config_text));
  std::optional<model::Checkpoint> checkpoint;  // a synthetic release reads none
  if (!options.synthetic_seed.has_value()) {
    ASSIGN_OR_RETURN(checkpoint, model::Checkpoint::Open(model_dir));
  }
  ASSIGN_OR_RETURN(const std::string codec_name, quant::ResolveCodecName(options.codec));
  ASSIGN_OR_RETURN(std::unique_ptr<quant::Codec> codec, quant::MakeCodec(codec_name));
  const int host_threads =
      options.host_threads > 0 ? options.host_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // One tile search per worker (a search is not shared between threads). A synthetic release's
  // templates are made on first use, so it runs on one worker.
  const int workers = options.synthetic_seed.has_value() ? 1 : std::max(1, options.workers);
  std::vector<std::unique_ptr<quant::TrellisTileSearch>> searches(static_cast<size_t>(workers));
  if (options.make_trellis_search && codec_name == quant::kTrellisV1) {
    for (std::unique_ptr<quant::TrellisTileSearch>& search : searches) {
      ASSIGN_OR_RETURN(search, options.make_trellis_search());
    }
  }
  const int refinements = options.codebook_refinements == kCodecDefaultRefinements
                              ? DefaultRefinements(codec_name, !options.calibration_path.empty())
                              : options.codebook_refinements;
  if (refinements < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--codebook_refinements ", refinements, " must be >= 0"));
  }
  if (refinements > 0 && codec_name == quant::kTrellisV1) {
    return absl::InvalidArgumentError(absl::StrCat("--codebook_refinements ", refinements,
                                                   ": trellis_v1's codebook is computed, not fitted; use 0"));
  }
  const int lowrank = options.lowrank.rank;
  if (lowrank < 0 || lowrank > quant::kMaxLowRank) {
    return absl::InvalidArgumentError(absl::StrCat("--lowrank_rank ", lowrank, " is outside [0, ", quant::kMaxLowRank, "]"));
  }
  if (lowrank > 0 && (options.synthetic_seed.has_value() || options.calibration_path.empty())) {
    return absl::InvalidArgumentError(
        "--lowrank_rank needs a calibration (--calib): corrections go where its Hessians show outlier channels"
        " (and a synthetic release has no weights to correct)");
  }
  const int world = options.tp_size;
  const int64_t E = config.n_routed_experts, D = config.hidden_size, I = config.moe_intermediate_size;
  if (world < 1 || I % world != 0) {
    return absl::InvalidArgumentError(absl::StrCat("moe_intermediate_size ", I, " does not split over --tp ", world));
  }
  if (options.fixed_per_layer < 0 || options.fixed_per_layer > E) {
    return absl::InvalidArgumentError(absl::StrCat("--fixed-per-layer ", options.fixed_per_layer, " of ", E, " experts"));
  }
  const int64_t Ir = I / world;
  const int64_t in_block = HadamardBlock(D, 128), gate_out_block = HadamardBlock(Ir, 128);
  const int64_t down_in_block = HadamardBlock(Ir, 512), down_out_block = HadamardBlock(D, 128);
  if (in_block == 0 || gate_out_block == 0 || down_in_block == 0 || down_out_block == 0) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_size ", D, " and moe_intermediate_size / tp ", Ir,
                                                   " must be multiples of ", quant::kMinHadamardBlock,
                                                   " for the Hadamard rotation"));
  }

  std::optional<Calibration> calibration;
  if (!options.calibration_path.empty()) {
    absl::StatusOr<Calibration> loaded = LoadCalibration(options.calibration_path);
    if (!loaded.ok()) return Annotate(loaded.status(), "--calib");
    calibration = *std::move(loaded);
  }
  // The ranking: most routed first with calibration, expert order without.
  auto ranking = [&](uint32_t layer) {
    std::vector<uint32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0u);
    if (calibration.has_value() && calibration->routing_counts.count(layer)) {
      const std::vector<double>& counts = calibration->routing_counts.at(layer);
      std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
        return (a < counts.size() ? counts[a] : 0) > (b < counts.size() ? counts[b] : 0);
      });
    }
    return order;
  };
  format::Manifest manifest;
  manifest.source_model = model_dir;
  manifest.config_hash = format::Sha256Hex(config_text);
  manifest.tp_size = static_cast<uint32_t>(world);
  manifest.experts_per_layer = static_cast<uint32_t>(E);
  manifest.codec = codec->name();
  manifest.codec_params = {{"base_bits", 2}, {"residual_bits", 2}, {"lambda", quant::EncodeOptions{}.lambda}};
  if (manifest.codec == quant::kNestedScalarV1) {
    // Informational: the levels themselves are stored per matrix.
    manifest.codec_params["base_grid"] = std::string(quant::BaseGridName(options.base_grid));
    manifest.codec_params["codebook_refinements"] = refinements;
  }
  if (manifest.codec == quant::kTrellisV1) {
    // What trellis_decode.h assumes; the resident codebook tensors hold per-16-column gains.
    manifest.codec_params["state_bits"] = quant::trellis::kStateBits;
    manifest.codec_params["tile"] = quant::trellis::kTileDim;
    manifest.codec_params["tail_biting"] = true;
  }
  if (lowrank > 0) {
    manifest.version = format::kLowRankFormatVersion;
    manifest.codec_params[format::kLowRankParam] =
        LowRankManifestParams(lowrank, options.lowrank.outlier_threshold, options.lowrank.min_gain);
  }
  std::vector<uint32_t> layers;
  for (int64_t l = 0; l < config.num_hidden_layers + config.num_nextn_predict_layers; ++l) {
    if (!config.IsMoeLayer(l)) continue;
    layers.push_back(static_cast<uint32_t>(l));
    format::ManifestLayer& ml = manifest.layers.emplace_back();
    ml.layer = static_cast<uint32_t>(l);
    ml.rotation = {static_cast<uint32_t>(down_in_block), 0x6e71u * 1000003u + static_cast<uint64_t>(l)};
    ml.ranking = ranking(static_cast<uint32_t>(l));
    ml.fixed_4bit.assign(ml.ranking.begin(), ml.ranking.begin() + options.fixed_per_layer);
  }
  ASSIGN_OR_RETURN(format::ReleaseWriter writer, format::ReleaseWriter::Create(out_dir, manifest));
  // nq encode's matrices: this rank's slice of the checkpoint's, LDLQ against calibration.
  auto encode_from_checkpoint = [&](const std::string& name, uint32_t layer, int rank, int64_t e, bool down,
                                    int64_t rows, int64_t cols,
                                    const quant::EncodeOptions& encode) -> absl::StatusOr<EncodedExpertMatrix> {
    ASSIGN_OR_RETURN(model::FloatTensor w, model::LoadFloat32(*checkpoint, name));
    std::vector<float> slice = Slice(w, /*split_rows=*/!down, rank, world);
    // LDLQ against the expert's calibration Hessian (this rank's slice of the down input).
    std::optional<quant::Hessian> hessian;
    if (calibration.has_value()) {
      auto it = calibration->experts.find({layer, static_cast<uint32_t>(e)});
      if (it != calibration->experts.end() && it->second.samples > 0) {
        const quant::Hessian& full = down ? it->second.down : it->second.gate_up;
        if (full.dim != (down ? I : D)) {
          return absl::InvalidArgumentError(absl::StrCat("--calib: ", name, " Hessian has dim ", full.dim));
        }
        hessian = quant::Hessian{cols, std::vector<double>(static_cast<size_t>(cols * cols))};
        const int64_t offset = down ? rank * cols : 0;
        for (int64_t i = 0; i < cols; ++i) {
          for (int64_t j = 0; j < cols; ++j) {
            hessian->values[i * cols + j] = full.values[(offset + i) * full.dim + offset + j];
          }
        }
      }
    }
    const quant::Hessian* h = hessian.has_value() ? &*hessian : nullptr;
    EncodedExpertMatrix out;
    ASSIGN_OR_RETURN(out.matrix, codec->Encode(slice, rows, cols, h, encode));
    ASSIGN_OR_RETURN(out.fit, quant::FitCorrection(*codec, out.matrix, slice, h, options.lowrank));
    return out;
  };
  std::map<std::string, quant::EncodedMatrix> templates;  // synthetic: one per projection

  // Progress counts experts (a trellis encode of one layer shard can take minutes).
  ProgressState progress{.total = static_cast<int64_t>(layers.size()) * world * E};
  const double weights_per_expert = 3.0 * static_cast<double>(D) * static_cast<double>(Ir);
  for (uint32_t layer : layers) {
    const format::ManifestLayer& ml = *manifest.FindLayer(layer);
    for (int rank = 0; rank < world; ++rank) {
      progress.stage = world > 1 ? absl::StrCat("layer ", layer, " rank ", rank) : absl::StrCat("layer ", layer);
      ASSIGN_OR_RETURN(bool have, writer.HasLayer(static_cast<uint32_t>(rank), layer));
      if (have) {
        progress.done += E;
        progress.skipped += E;
        if (options.progress) options.progress(progress);
        continue;
      }
      // This (layer, rank)'s experts, encoded by the workers in hand-out order; written here in
      // expert order as each one's turn comes, so the files do not depend on the workers.
      auto encode_expert = [&](int64_t e, quant::TrellisTileSearch* search) -> absl::StatusOr<ExpertMatrices> {
        ExpertMatrices out;
        for (size_t i = 0; i < std::size(kProjections); ++i) {
          const char* proj = kProjections[i];
          const std::string name = absl::StrCat("model.layers.", layer, ".mlp.experts.", e, ".", proj, ".weight");
          const bool down = std::string(proj) == "down_proj";
          const int64_t rows = down ? D : Ir, cols = down ? Ir : D;
          quant::EncodeOptions encode;
          encode.base_grid = options.base_grid;
          encode.codebook_refinements = refinements;
          encode.trellis_search = search;
          encode.host_threads = host_threads;
          encode.rotation = {.row_block = down ? down_out_block : gate_out_block,
                             .col_block = down ? down_in_block : in_block,
                             .row_sign_seed = ml.rotation.sign_seed * 31 + 1,
                             .col_sign_seed = ml.rotation.sign_seed * 31 + 2};
          if (options.synthetic_seed.has_value()) {
            absl::StatusOr<quant::EncodedMatrix> m =
                SyntheticMatrix(*codec, rows, cols, encode, *options.synthetic_seed,
                                {layer, static_cast<uint32_t>(rank), static_cast<uint32_t>(e), proj}, templates);
            if (!m.ok()) return Annotate(m.status(), name);
            out.matrices[i] = *std::move(m);
            continue;
          }
          absl::StatusOr<EncodedExpertMatrix> m = encode_from_checkpoint(name, layer, rank, e, down, rows, cols, encode);
          if (!m.ok()) return Annotate(m.status(), name);
          out.matrices[i] = std::move(m->matrix);
          out.fits[i] = std::move(m->fit);
        }
        return out;
      };
      // Two items a worker past the one being written: enough to keep every worker busy.
      OrderedWork<ExpertMatrices> pipeline(E, workers, 2 * workers, [&](int64_t e, int worker) {
        return encode_expert(e, searches[static_cast<size_t>(worker)].get());
      });

      // Every expert first: which projections carry a correction in some expert decides the
      // layer's record layout, which all its records share.
      std::vector<ExpertMatrices> experts;
      experts.reserve(static_cast<size_t>(E));
      std::array<bool, kNumProjections> corrected{};
      for (int64_t e = 0; e < E; ++e) {
        ASSIGN_OR_RETURN(ExpertMatrices matrices, pipeline.Take(e));
        for (size_t i = 0; i < kNumProjections; ++i) corrected[i] |= !matrices.fits[i].correction.empty();
        experts.push_back(std::move(matrices));
        ++progress.done;
        progress.work += weights_per_expert;
        if (options.progress) options.progress(progress);
      }
      model::SafetensorsWriter resident;
      std::vector<std::vector<std::byte>> records;
      std::optional<format::RecordLayout> layout;
      for (int64_t e = 0; e < E; ++e) {
        ExpertMatrices& matrices = experts[static_cast<size_t>(e)];
        std::vector<std::vector<uint8_t>> segments;
        std::vector<format::SegmentSpec> specs;
        for (size_t i = 0; i < kNumProjections; ++i) {
          const char* proj = kProjections[i];
          const bool down = std::string(proj) == "down_proj";
          const int64_t rows = down ? D : Ir, cols = down ? Ir : D;
          quant::EncodedMatrix* m = &matrices.matrices[i];
          const std::string key = absl::StrCat("experts.", e, ".", proj);
          RETURN_IF_ERROR(resident.Add(key + ".base", model::DType::kU8, {static_cast<int64_t>(m->base_codes.size())},
                                       Bytes(m->base_codes)));
          RETURN_IF_ERROR(resident.AddFloat32(key + ".row_scales", {rows}, m->row_scales));
          RETURN_IF_ERROR(resident.AddFloat32(key + ".col_scales", {cols}, m->col_scales));
          // The codebooks are fitted per matrix; the rotation is what the decoder must undo.
          RETURN_IF_ERROR(resident.AddFloat32(key + ".base_codebook",
                                              {static_cast<int64_t>(m->params.base_codebook.size())},
                                              m->params.base_codebook));
          RETURN_IF_ERROR(resident.AddFloat32(key + ".residual_codebook",
                                              {static_cast<int64_t>(m->params.residual_codebook.size())},
                                              m->params.residual_codebook));
          const int64_t rotation[4] = {m->params.rotation.row_block, m->params.rotation.col_block,
                                       static_cast<int64_t>(m->params.rotation.row_sign_seed),
                                       static_cast<int64_t>(m->params.rotation.col_sign_seed)};
          std::vector<std::byte> rotation_bytes(sizeof(rotation));
          std::memcpy(rotation_bytes.data(), rotation, sizeof(rotation));
          RETURN_IF_ERROR(resident.Add(key + ".rotation", model::DType::kI64, {4}, std::move(rotation_bytes)));
          const quant::LowRankCorrection& correction = matrices.fits[i].correction;
          if (!correction.empty()) {
            RETURN_IF_ERROR(AddResidentFactors(resident, key, correction.base));
          }
          specs.push_back({std::string(proj) + ".residual", m->residual_codes.size()});
          segments.push_back(std::move(m->residual_codes));
        }
        // The factor segments come after every residual plane, so the planes keep the offsets a
        // release without corrections gives them.
        for (size_t i = 0; i < kNumProjections; ++i) {
          if (!corrected[i]) continue;
          const quant::EncodedMatrix& m = matrices.matrices[i];
          const quant::LowRankCorrection& correction = matrices.fits[i].correction;
          specs.push_back({LowRankSegment(kProjections[i]), static_cast<uint64_t>(quant::LowRankBytes(m.rows, m.cols, lowrank))});
          segments.push_back(correction.empty() ? std::vector<uint8_t>(specs.back().bytes, 0)
                                                : quant::PackLowRank(correction.residual, lowrank));
        }
        if (!layout.has_value()) {
          ASSIGN_OR_RETURN(layout, format::RecordLayout::Build(specs));
          if (options.lowrank_stats != nullptr) {
            ASSIGN_OR_RETURN(format::RecordLayout planes_only,
                             format::RecordLayout::Build(std::span(specs).first(kNumProjections)));
            options.lowrank_stats->record_bytes += E * static_cast<int64_t>(layout->rec_bytes - planes_only.rec_bytes);
          }
        }
        std::vector<std::span<const std::byte>> parts;
        for (const std::vector<uint8_t>& r : segments) {
          parts.emplace_back(reinterpret_cast<const std::byte*>(r.data()), r.size());
        }
        ASSIGN_OR_RETURN(std::vector<std::byte> record, layout->Pack(parts));
        records.push_back(std::move(record));
        if (options.lowrank_stats != nullptr && lowrank > 0) {
          LowRankStats& stats = *options.lowrank_stats;
          for (const quant::CorrectionFit& fit : matrices.fits) {
            ++stats.matrices;
            if (fit.outliers.count > 0) ++stats.with_outliers;
            if (fit.correction.empty()) continue;
            ++stats.kept;
            stats.error2 += fit.error2;
            stats.error2_corrected += fit.error2_corrected;
            stats.error4 += fit.error4;
            stats.error4_corrected += fit.error4_corrected;
            stats.resident_bytes += 2 * static_cast<int64_t>(fit.correction.base.u.size() + fit.correction.base.v.size());
          }
        }
      }
      resident.SetMetadata("codec", codec->name());
      RETURN_IF_ERROR(writer.WriteLayer(static_cast<uint32_t>(rank), layer, *layout, records, resident));
    }
  }
  return writer.Finish();
}

void FillRandomCodes(std::span<uint8_t> plane, int64_t used_bits, uint64_t seed) {
  uint64_t state = seed;
  size_t i = 0;
  for (; i + 8 <= plane.size(); i += 8) {
    const uint64_t word = SplitMix64(state);
    std::memcpy(plane.data() + i, &word, 8);
  }
  if (i < plane.size()) {
    const uint64_t word = SplitMix64(state);
    std::memcpy(plane.data() + i, &word, plane.size() - i);
  }
  const int64_t tail_bits = used_bits % 8;
  const size_t used_bytes = static_cast<size_t>((used_bits + 7) / 8);
  if (tail_bits != 0 && used_bytes <= plane.size()) plane[used_bytes - 1] &= static_cast<uint8_t>((1u << tail_bits) - 1);
  for (size_t b = used_bytes; b < plane.size(); ++b) plane[b] = 0;
}

absl::StatusOr<quant::EncodedMatrix> LoadResidentExpert(const model::SafetensorsFile& resident,
                                                        const std::string& codec, uint32_t expert,
                                                        const std::string& projection) {
  const std::string key = absl::StrCat("experts.", expert, ".", projection);
  auto floats = [&](const std::string& name) -> absl::StatusOr<std::vector<float>> {
    ASSIGN_OR_RETURN(model::TensorView view, resident.Find(name));
    return model::ConvertToFloat32(view.dtype, view.data);
  };
  quant::EncodedMatrix m;
  ASSIGN_OR_RETURN(m.row_scales, floats(key + ".row_scales"));
  ASSIGN_OR_RETURN(m.col_scales, floats(key + ".col_scales"));
  m.rows = static_cast<int64_t>(m.row_scales.size());
  m.cols = static_cast<int64_t>(m.col_scales.size());
  ASSIGN_OR_RETURN(m.params.base_codebook, floats(key + ".base_codebook"));
  ASSIGN_OR_RETURN(m.params.residual_codebook, floats(key + ".residual_codebook"));
  ASSIGN_OR_RETURN(model::TensorView rotation, resident.Find(key + ".rotation"));
  if (rotation.dtype != model::DType::kI64 || rotation.data.size() != 4 * sizeof(int64_t)) {
    return absl::DataLossError(absl::StrCat(resident.path(), ": ", key, ".rotation is not I64[4]"));
  }
  int64_t r[4];
  std::memcpy(r, rotation.data.data(), sizeof(r));
  m.params.rotation = {.row_block = r[0], .col_block = r[1], .row_sign_seed = static_cast<uint64_t>(r[2]),
                       .col_sign_seed = static_cast<uint64_t>(r[3])};
  m.params.codec = codec;
  ASSIGN_OR_RETURN(model::TensorView base, resident.Find(key + ".base"));
  m.base_codes.assign(reinterpret_cast<const uint8_t*>(base.data.data()),
                      reinterpret_cast<const uint8_t*>(base.data.data()) + base.data.size());
  return m;
}

absl::Status AttachRecordResidual(const format::RecordLayout& layout, std::span<const std::byte> record,
                                  const std::string& projection, quant::EncodedMatrix& m) {
  ASSIGN_OR_RETURN(std::span<const std::byte> plane, layout.Unpack(record, projection + ".residual"));
  return quant::AttachResidual(m, std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(plane.data()),
                                                       reinterpret_cast<const uint8_t*>(plane.data()) + plane.size()));
}

absl::StatusOr<quant::EncodedMatrix> LoadReleaseExpert(const format::Release& release, uint32_t rank, uint32_t layer,
                                                       uint32_t expert, const std::string& projection,
                                                       bool with_residual) {
  ASSIGN_OR_RETURN(std::string resident_path, release.ResidentPath(rank, layer));
  ASSIGN_OR_RETURN(model::SafetensorsFile resident, model::SafetensorsFile::Open(resident_path));
  ASSIGN_OR_RETURN(quant::EncodedMatrix m, LoadResidentExpert(resident, release.manifest().codec, expert, projection));
  if (with_residual) {
    ASSIGN_OR_RETURN(const format::LayerEntry* entry, release.Layer(rank, layer));
    ASSIGN_OR_RETURN(std::vector<std::byte> record, release.ReadRecord(rank, layer, expert));
    RETURN_IF_ERROR(AttachRecordResidual(entry->layout, record, projection, m));
  }
  return m;
}

}  // namespace nq::release
