// Decodes a release's routed experts into the dense weights the model runs (DESIGN.md
// sections 5-6): the 2-bit weights from the resident file alone, the 4-bit weights from the
// resident base plus one residual record, read from the release or taken from the bytes of
// a worker's slot. Each layer's resident file is opened (mapped) once and kept.
//
//   ASSIGN_OR_RETURN(auto decoder, ReleaseExpertDecoder::Open(release_dir, model_dir, config, tp));
//   ASSIGN_OR_RETURN(model::MlpWeights w, decoder->Upload(layer, expert, slot_bytes, backend));
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "services/format/release_reader.h"
#include "services/model/model_config.h"
#include "services/model/model_weights.h"
#include "services/model/safetensors.h"
#include "services/quant/codec.h"

namespace nq::release {

// One expert's decoded matrices, in the model's layout: gate rows then up rows, and down.
struct DecodedExpert {
  int64_t intermediate = 0;  // rows of gate_proj (this rank's slice)
  int64_t hidden = 0;
  std::vector<float> gate_up;  // [2 * intermediate, hidden]
  std::vector<float> down;     // [hidden, intermediate]
};

class ReleaseExpertDecoder {
 public:
  // Opens `release_dir` (refused without COMPLETE) and checks it was made from this model:
  // config hash of `model_dir`/config.json, TP size, MoE layers and experts
  // (FAILED_PRECONDITION naming the mismatch).
  // `verify`: hash manifest, rank indexes and this rank's resident files first
  // (format::Release::VerifyForServing); DATA_LOSS naming every file that differs. Serving
  // never trusts bytes it did not check: records are checked by the streamer as it reads them.
  static absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> Open(const std::string& release_dir,
                                                                    const std::string& model_dir,
                                                                    const model::ModelConfig& config,
                                                                    model::TensorParallel tp, bool verify = true);

  const format::Release& release() const { return release_; }
  const std::vector<uint32_t>& moe_layer_ids() const { return moe_layer_ids_; }
  // rec_bytes of `layer`'s records for this rank.
  absl::StatusOr<uint64_t> RecordBytes(uint32_t layer) const;
  // This rank's residual record of (layer, expert), read from the release's record file and
  // checked against its checksum in the index (Release::CheckRecord: DATA_LOSS when damaged),
  // as the streamer checks its reads: a layer-major prefill's 4-bit experts and a worker's
  // --verify_slots reference come through here.
  absl::StatusOr<std::vector<std::byte>> ReadRecord(uint32_t layer, uint32_t expert) const;
  // The manifest's fixed 4-bit set of `layer` (empty for an unknown layer).
  std::vector<uint32_t> FixedSet(uint32_t layer) const;
  // What a slot arena for this release needs: the largest record of any MoE layer (a slot's
  // size) and the largest fixed set (fixed slots per layer), and all fixed sets together.
  struct SlotNeeds {
    uint64_t rec_bytes = 0;
    size_t largest_fixed = 0;
    size_t fixed_total = 0;
  };
  absl::StatusOr<SlotNeeds> Needs() const;

  // 2 bits: `record` must be empty. 4 bits: the residual comes from `record` (exactly the
  // layer's rec_bytes), or, when `record` is empty, from the release's record file. A matrix with a
  // low-rank correction gets its base factors at 2 bits and both levels' at 4
  // (quant::DecodeCorrected); DATA_LOSS for damaged factors. Thread-safe.
  absl::StatusOr<DecodedExpert> Decode(uint32_t layer, uint32_t expert, quant::Precision precision,
                                       std::span<const std::byte> record = {}) const;
  // Decode, then upload as F32 tensors on `backend`.
  absl::StatusOr<model::MlpWeights> Upload(uint32_t layer, uint32_t expert, quant::Precision precision,
                                           std::span<const std::byte> record, kernels::Backend& backend) const;

  // The rank's index entry of `layer` (record layout, files) and its resident planes, mapped
  // once and kept. NOT_FOUND for a layer the release does not hold.
  absl::StatusOr<const format::LayerEntry*> Layer(uint32_t layer) const { return release_.Layer(rank_, layer); }
  absl::StatusOr<const model::SafetensorsFile*> Resident(uint32_t layer) const;
  uint32_t rank() const { return rank_; }
  // The release's low-rank max_rank (services/release/low_rank_io.h); 0 without corrections.
  int lowrank_max_rank() const { return lowrank_max_rank_; }

 private:
  ReleaseExpertDecoder(format::Release release, std::unique_ptr<quant::Codec> codec, uint32_t rank,
                       std::vector<uint32_t> moe_layer_ids, int lowrank_max_rank)
      : release_(std::move(release)),
        codec_(std::move(codec)),
        rank_(rank),
        moe_layer_ids_(std::move(moe_layer_ids)),
        lowrank_max_rank_(lowrank_max_rank) {}

  const format::Release release_;
  const std::unique_ptr<quant::Codec> codec_;
  const uint32_t rank_;
  const std::vector<uint32_t> moe_layer_ids_;
  const int lowrank_max_rank_;
  mutable absl::Mutex mu_;
  mutable std::map<uint32_t, std::unique_ptr<model::SafetensorsFile>> resident_ ABSL_GUARDED_BY(mu_);
};

}  // namespace nq::release
