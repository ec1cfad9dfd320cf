#include "services/release/release_expert_decoder.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/quant/low_rank_fit.h"
#include "services/release/low_rank_io.h"
#include "services/release/release_encoder.h"

namespace nq::release {

absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> ReleaseExpertDecoder::Open(const std::string& release_dir,
                                                                                 const std::string& model_dir,
                                                                                 const model::ModelConfig& config,
                                                                                 model::TensorParallel tp,
                                                                                 bool verify) {
  ASSIGN_OR_RETURN(format::Release release, format::Release::Open(release_dir));
  if (verify) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const format::VerifyReport report = release.VerifyForServing(static_cast<uint32_t>(tp.rank), static_cast<int>(cores));
    if (!report.ok()) {
      return absl::DataLossError(absl::StrCat("release ", release_dir, " fails its checksums (run nq verify; ",
                                              "re-copy or re-encode the files named):\n", report.ToString()));
    }
  }
  format::ModelIdentity identity;
  // The manifest's config hash is the sha256 of the exact config.json bytes (nq encode).
  ASSIGN_OR_RETURN(identity.config_hash, format::Sha256File(model_dir + "/config.json"));
  identity.tp_size = static_cast<uint32_t>(tp.world_size);
  identity.experts_per_layer = static_cast<uint32_t>(config.n_routed_experts);
  for (int64_t l = 0; l < config.num_hidden_layers + config.num_nextn_predict_layers; ++l) {
    if (config.IsMoeLayer(l)) identity.moe_layer_ids.push_back(static_cast<uint32_t>(l));
  }
  RETURN_IF_ERROR(release.CheckMatchesModel(identity));
  absl::StatusOr<std::unique_ptr<quant::Codec>> codec = quant::MakeCodec(release.manifest().codec);
  if (!codec.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("release ", release_dir, " is coded with '",
                                                      release.manifest().codec, "', which this build cannot decode: ",
                                                      codec.status().message()));
  }
  ASSIGN_OR_RETURN(const int lowrank, ReleaseLowRank(release.manifest()));
  return std::unique_ptr<ReleaseExpertDecoder>(new ReleaseExpertDecoder(std::move(release), *std::move(codec),
                                                                        static_cast<uint32_t>(tp.rank),
                                                                        std::move(identity.moe_layer_ids), lowrank));
}

absl::StatusOr<std::vector<std::byte>> ReleaseExpertDecoder::ReadRecord(uint32_t layer, uint32_t expert) const {
  ASSIGN_OR_RETURN(std::vector<std::byte> record, release_.ReadRecord(rank_, layer, expert));
  RETURN_IF_ERROR(release_.CheckRecord(rank_, layer, expert, record));
  return record;
}

absl::StatusOr<uint64_t> ReleaseExpertDecoder::RecordBytes(uint32_t layer) const {
  ASSIGN_OR_RETURN(const format::LayerEntry* entry, release_.Layer(rank_, layer));
  return entry->layout.rec_bytes;
}

std::vector<uint32_t> ReleaseExpertDecoder::FixedSet(uint32_t layer) const {
  const format::ManifestLayer* ml = release_.manifest().FindLayer(layer);
  return ml == nullptr ? std::vector<uint32_t>{} : ml->fixed_4bit;
}

absl::StatusOr<ReleaseExpertDecoder::SlotNeeds> ReleaseExpertDecoder::Needs() const {
  SlotNeeds needs;
  for (uint32_t layer : moe_layer_ids_) {
    ASSIGN_OR_RETURN(uint64_t bytes, RecordBytes(layer));
    needs.rec_bytes = std::max(needs.rec_bytes, bytes);
    const size_t fixed = FixedSet(layer).size();
    needs.largest_fixed = std::max(needs.largest_fixed, fixed);
    needs.fixed_total += fixed;
  }
  return needs;
}

absl::StatusOr<const model::SafetensorsFile*> ReleaseExpertDecoder::Resident(uint32_t layer) const {
  absl::MutexLock lock(&mu_);
  auto it = resident_.find(layer);
  if (it != resident_.end()) return it->second.get();
  ASSIGN_OR_RETURN(std::string path, release_.ResidentPath(rank_, layer));
  ASSIGN_OR_RETURN(model::SafetensorsFile file, model::SafetensorsFile::Open(path));
  auto owned = std::make_unique<model::SafetensorsFile>(std::move(file));
  const model::SafetensorsFile* raw = owned.get();
  resident_.emplace(layer, std::move(owned));
  return raw;
}

absl::StatusOr<DecodedExpert> ReleaseExpertDecoder::Decode(uint32_t layer, uint32_t expert, quant::Precision precision,
                                                           std::span<const std::byte> record) const {
  const bool four = precision == quant::Precision::k4Bit;
  if (!four && !record.empty()) {
    return absl::InvalidArgumentError("a 2-bit decode takes no residual record");
  }
  ASSIGN_OR_RETURN(const format::LayerEntry* entry, release_.Layer(rank_, layer));
  std::vector<std::byte> read;
  if (four && record.empty()) {
    ASSIGN_OR_RETURN(read, ReadRecord(layer, expert));
    record = read;
  }
  if (four && record.size() != entry->layout.rec_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("record of layer ", layer, " expert ", expert, " has ",
                                                   record.size(), " bytes, want ", entry->layout.rec_bytes));
  }
  ASSIGN_OR_RETURN(const model::SafetensorsFile* resident, Resident(layer));
  DecodedExpert out;
  for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) {
    ASSIGN_OR_RETURN(quant::EncodedMatrix m, LoadResidentExpert(*resident, release_.manifest().codec, expert, projection));
    if (four) RETURN_IF_ERROR(AttachRecordResidual(entry->layout, record, projection, m));
    quant::LowRankCorrection correction;
    if (lowrank_max_rank_ > 0) {
      ASSIGN_OR_RETURN(correction.base,
                       LoadResidentFactors(*resident, expert, projection, m.rows, m.cols, lowrank_max_rank_));
      if (four) {
        absl::StatusOr<quant::LowRankFactors> residual = LoadRecordFactors(
            entry->layout, record, projection, m.rows, m.cols, correction.base.rank, lowrank_max_rank_);
        if (!residual.ok()) {
          return Annotate(residual.status(), absl::StrCat("layer ", layer, " expert ", expert, " record"));
        }
        correction.residual = *std::move(residual);
      }
    }
    std::vector<float> w(static_cast<size_t>(m.rows * m.cols));
    RETURN_IF_ERROR(quant::DecodeCorrected(*codec_, m, correction, precision, w));
    if (std::string(projection) == "down_proj") {
      out.down = std::move(w);
      out.hidden = m.rows;
    } else {
      out.intermediate = m.rows;
      out.gate_up.insert(out.gate_up.end(), w.begin(), w.end());
    }
  }
  return out;
}

absl::StatusOr<model::MlpWeights> ReleaseExpertDecoder::Upload(uint32_t layer, uint32_t expert,
                                                               quant::Precision precision,
                                                               std::span<const std::byte> record,
                                                               kernels::Backend& backend) const {
  ASSIGN_OR_RETURN(DecodedExpert d, Decode(layer, expert, precision, record));
  model::MlpWeights w;
  ASSIGN_OR_RETURN(w.gate_up, kernels::UploadFloats(backend, d.gate_up, kernels::DType::kF32,
                                                    kernels::Shape{2 * d.intermediate, d.hidden}));
  ASSIGN_OR_RETURN(w.down, kernels::UploadFloats(backend, d.down, kernels::DType::kF32,
                                                 kernels::Shape{d.hidden, d.intermediate}));
  return w;
}

}  // namespace nq::release
