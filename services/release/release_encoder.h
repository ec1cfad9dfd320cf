// `nq encode`: an HF checkpoint's routed experts into a NestQuant release (DESIGN.md section
// 5): per MoE layer and tensor-parallel rank, every expert's 2-bit base planes and scales in
// the resident file, its 2-bit residual planes in one O_DIRECT-aligned record. Resumable: a
// layer already written with matching hashes is skipped.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/common/progress.h"
#include "services/format/release_reader.h"
#include "services/quant/nested_codebook.h"
#include "services/model/safetensors.h"
#include "services/quant/codec.h"
#include "services/quant/low_rank.h"
#include "services/quant/low_rank_fit.h"
#include "services/quant/trellis_search.h"

namespace nq::release {

// What EncodeRelease's low-rank pass found, summed over every expert matrix it encoded.
struct LowRankStats {
  int64_t matrices = 0;       // expert matrices encoded
  int64_t with_outliers = 0;  // of those, with an outlier channel (fitted)
  int64_t kept = 0;           // of those, whose correction was kept
  // Hessian-weighted errors summed over the kept matrices, before and after the correction.
  double error2 = 0, error2_corrected = 0, error4 = 0, error4_corrected = 0;
  int64_t resident_bytes = 0;  // factor tensors in the resident files
  int64_t record_bytes = 0;    // record bytes added by the factor segments, summed over records
};

// EncodeReleaseOptions::codebook_refinements: whatever suits the codec and the calibration
// (DefaultRefinements).
inline constexpr int kCodecDefaultRefinements = -1;
// One refit for nested_scalar_v1 with calibration Hessians (LDLQ's targets drift from N(0,1),
// and the refit follows them); none without (identity Hessians: neutral on glm5_nano, mean KL
// +0.8 % at 2 bits and -3 % at 4) and none for trellis_v1, whose codebook is computed.
int DefaultRefinements(absl::string_view codec_name, bool calibrated);

struct EncodeReleaseOptions {
  int tp_size = 1;
  // Experts per layer pinned at 4 bits by default (the first of the ranking).
  int fixed_per_layer = 0;
  // A registry name or a short name ("scalar", "trellis": quant::ResolveCodecName); the
  // manifest records the registry name.
  std::string codec = "nested_scalar_v1";
  // nested_scalar_v1's levels (quant::BaseGrid): base levels on an even grid (the GPU's fast 2-bit
  // decode; 1.2 % more 2-bit MSE on N(0,1), no more at 4 bits), free Lloyd levels, or uniform
  // nested levels (the fast 4-bit decode too; more 4-bit MSE: nested_codebook.h).
  quant::BaseGrid base_grid = quant::BaseGrid::kUniform;
  // Lloyd refits of each matrix's codebook to its own targets (quant::EncodeOptions::
  // codebook_refinements; each one more quantisation pass). kCodecDefaultRefinements: one for
  // nested_scalar_v1 with a calibration (glm5_nano: mean KL 5 % lower at 2 bits, 11 % at 4,
  // docs/encoding.md), otherwise none (DefaultRefinements). The manifest records the count.
  int codebook_refinements = kCodecDefaultRefinements;
  // nq calibrate output: per-expert Hessians for LDLQ and the ranking by routing counts.
  // Empty: identity Hessians and expert order.
  std::string calibration_path;
  // Called after each expert of each (layer, rank): experts done of layers x ranks x experts,
  // weights encoded by this run, the (layer, rank) at work. A (layer, rank) already written
  // (a resumed encode) counts all its experts at once as skipped.
  std::function<void(const ProgressState&)> progress;
  // Set: a synthetic release (`nq synth-release`). The checkpoint is not opened (config.json is
  // all it needs), and the experts are made up instead of encoded: per rank and projection, one
  // random N(0, 1/in) matrix at the real shape is encoded for its scales and codebooks, and every
  // expert of every layer gets those with its own random codes drawn from this seed (trellis_v1:
  // the encoded codes themselves, whose Viterbi paths random bits would not be). Every file has
  // the size and layout a real release of the config has, in seconds instead of hours: for
  // benchmarks at sizes no checkpoint on hand reaches (a GLM-5 MoE layer is 9.7B weights). Its
  // experts compute nothing meaningful.
  std::optional<uint64_t> synthetic_seed;
  // Experts encoded at once, each worker a thread with its own trellis_v1 tile search from
  // make_trellis_search (unset: the codec's one-thread CPU search). The release's bytes do not
  // depend on either: experts are written in order, and every search gives the same symbols.
  // `nq encode` runs one worker per core with --device cpu, eight per GPU with --device cuda (some
  // encode on the host while the others' tiles are on the GPU). A synthetic release uses one.
  int workers = 1;
  std::function<absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>>()> make_trellis_search;
  // Threads for the codecs' host work that splits without changing bytes (trellis_v1's LDLQ
  // feedback); 0: one per hardware thread.
  int host_threads = 1;
  // Low-rank corrections (issue #16; services/quant/low_rank.h): rank 0 (the default) writes none,
  // and the release is byte-identical to one from before they existed. Needs calibration_path
  // (outliers are found in the calibration Hessians); refused with synthetic_seed.
  quant::LowRankOptions lowrank;
  // Set: filled with what the corrections did (for nq encode's summary).
  LowRankStats* lowrank_stats = nullptr;
};


// One expert matrix of a release as the codec reads it: base plane, scales, codebooks and
// rotation from the resident file; with `with_residual`, the residual plane from its record.
// `projection` is "gate_proj", "up_proj" or "down_proj".
// The same from an open resident file (no residual): what a worker keeps per expert.
absl::StatusOr<quant::EncodedMatrix> LoadResidentExpert(const model::SafetensorsFile& resident,
                                                        const std::string& codec, uint32_t expert,
                                                        const std::string& projection);
// Attaches `projection`'s residual plane from one expert record (a release read or a slot).
absl::Status AttachRecordResidual(const format::RecordLayout& layout, std::span<const std::byte> record,
                                  const std::string& projection, quant::EncodedMatrix& m);

absl::StatusOr<quant::EncodedMatrix> LoadReleaseExpert(const format::Release& release, uint32_t rank, uint32_t layer,
                                                       uint32_t expert, const std::string& projection,
                                                       bool with_residual);

absl::Status EncodeRelease(const std::string& model_dir, const std::string& out_dir,
                           const EncodeReleaseOptions& options);

// Fills `plane` with random codes from `seed` (splitmix64: fast enough for tens of GB), leaving
// the padding bits past `used_bits` zero as PackCodes does.
void FillRandomCodes(std::span<uint8_t> plane, int64_t used_bits, uint64_t seed);

}  // namespace nq::release
