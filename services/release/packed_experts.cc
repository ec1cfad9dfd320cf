#include "services/release/packed_experts.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/quant/hadamard.h"
#include "services/quant/nested_codebook.h"
#include "services/quant/nested_scalar_codec.h"
#include "services/quant/trellis_codec.h"
#include "services/release/low_rank_io.h"
#include "services/release/release_encoder.h"

namespace nq::release {
namespace {

struct HostProjection {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> base;
  std::vector<float> row_scales, col_scales;
  std::vector<float> levels;  // nested_scalar_v1
  std::vector<float> gains;   // trellis_v1
  quant::RotationParams rotation;
  // Base-level low-rank factors padded to the release's max rank R: [E][rows][R], [E][R][cols];
  // empty when no expert of the layer corrects this projection.
  std::vector<float> lowrank_u, lowrank_v;
};

// Appends expert e's base factors (rank <= R) zero-padded to R.
void AppendPadded(const quant::LowRankFactors& f, int64_t R, HostProjection& h) {
  const size_t u0 = h.lowrank_u.size(), v0 = h.lowrank_v.size();
  h.lowrank_u.resize(u0 + static_cast<size_t>(f.rows * R), 0.0f);
  h.lowrank_v.resize(v0 + static_cast<size_t>(R * f.cols), 0.0f);
  for (int64_t i = 0; i < f.rows; ++i) {
    for (int k = 0; k < f.rank; ++k) h.lowrank_u[u0 + i * R + k] = f.u[i * f.rank + k];
  }
  std::copy(f.v.begin(), f.v.end(), h.lowrank_v.begin() + static_cast<int64_t>(v0));
}

absl::StatusOr<kernels::NqCodec> PackedCodec(const std::string& codec) {
  if (codec == quant::kNestedScalarV1) return kernels::NqCodec::kNestedScalar;
  if (codec == quant::kTrellisV1) return kernels::NqCodec::kTrellis;
  return absl::FailedPreconditionError(absl::StrCat("release codec '", codec, "' has no packed MoE kernel (have: ",
                                                    quant::kNestedScalarV1, ", ", quant::kTrellisV1, ")"));
}

// The level table of kernels/nq_moe.h: the 4 base levels, then base[b] + residual[4b + r] added
// in float as NestedScalarCodec::Decode adds them.
absl::Status AppendLevels(const quant::CodecParams& p, const std::string& what, std::vector<float>& levels) {
  if (p.base_codebook.size() != quant::kBaseLevels ||
      p.residual_codebook.size() != quant::kBaseLevels * quant::kResidualLevels) {
    return absl::DataLossError(absl::StrCat(what, ": codebooks of ", p.base_codebook.size(), " and ",
                                            p.residual_codebook.size(), " levels, want 4 and 16"));
  }
  levels.insert(levels.end(), p.base_codebook.begin(), p.base_codebook.end());
  for (int b = 0; b < quant::kBaseLevels; ++b) {
    for (int r = 0; r < quant::kResidualLevels; ++r) {
      float v = p.base_codebook[b];
      v += p.residual_codebook[b * quant::kResidualLevels + r];
      levels.push_back(v);
    }
  }
  return absl::OkStatus();
}

// trellis_v1's gains as kernels/nq_moe.h wants them: the base and residual gain of each
// 16-column block (the codec's base_codebook[tj], residual_codebook[tj]) side by side.
absl::Status AppendGains(const quant::EncodedMatrix& m, const std::string& what, std::vector<float>& gains) {
  if (m.rows % kernels::kNqTrellisBlock != 0 || m.cols % kernels::kNqTrellisBlock != 0) {
    return absl::DataLossError(absl::StrCat(what, " is ", m.rows, " x ", m.cols, ", not whole 16 x 16 tiles"));
  }
  const size_t blocks = static_cast<size_t>(m.cols / kernels::kNqTrellisBlock);
  const quant::CodecParams& p = m.params;
  if (p.base_codebook.size() != blocks || p.residual_codebook.size() != blocks) {
    return absl::DataLossError(absl::StrCat(what, ": gains of ", p.base_codebook.size(), " and ",
                                            p.residual_codebook.size(), " column blocks, want ", blocks));
  }
  for (size_t b = 0; b < blocks; ++b) {
    gains.push_back(p.base_codebook[b]);
    gains.push_back(p.residual_codebook[b]);
  }
  return absl::OkStatus();
}

absl::StatusOr<HostProjection> ReadProjection(const model::SafetensorsFile& resident, const std::string& codec,
                                              uint32_t experts, const std::string& projection, int lowrank) {
  HostProjection h;
  std::vector<quant::LowRankFactors> factors;
  for (uint32_t e = 0; e < experts; ++e) {
    ASSIGN_OR_RETURN(quant::EncodedMatrix m, LoadResidentExpert(resident, codec, e, projection));
    const std::string what = absl::StrCat(resident.path(), ": expert ", e, " ", projection);
    if (e == 0) {
      h.rows = m.rows;
      h.cols = m.cols;
      h.rotation = m.params.rotation;
    } else if (m.rows != h.rows || m.cols != h.cols) {
      return absl::FailedPreconditionError(absl::StrCat(what, " is ", m.rows, " x ", m.cols, ", expert 0's ", h.rows,
                                                        " x ", h.cols));
    } else if (m.params.rotation.row_block != h.rotation.row_block ||
               m.params.rotation.col_block != h.rotation.col_block ||
               m.params.rotation.row_sign_seed != h.rotation.row_sign_seed ||
               m.params.rotation.col_sign_seed != h.rotation.col_sign_seed) {
      // The kernels rotate a layer's input once and its output once: one rotation per layer.
      return absl::FailedPreconditionError(absl::StrCat(what, " is rotated unlike expert 0 of its layer"));
    }
    if (static_cast<int64_t>(m.base_codes.size()) != kernels::NqPlaneBytes(m.rows, m.cols)) {
      return absl::DataLossError(absl::StrCat(what, ": base plane of ", m.base_codes.size(), " bytes, want ",
                                              kernels::NqPlaneBytes(m.rows, m.cols)));
    }
    h.base.insert(h.base.end(), m.base_codes.begin(), m.base_codes.end());
    h.row_scales.insert(h.row_scales.end(), m.row_scales.begin(), m.row_scales.end());
    h.col_scales.insert(h.col_scales.end(), m.col_scales.begin(), m.col_scales.end());
    if (codec == quant::kTrellisV1) {
      RETURN_IF_ERROR(AppendGains(m, what, h.gains));
    } else {
      RETURN_IF_ERROR(AppendLevels(m.params, what, h.levels));
    }
    if (lowrank > 0) {
      ASSIGN_OR_RETURN(factors.emplace_back(), LoadResidentFactors(resident, e, projection, m.rows, m.cols, lowrank));
    }
  }
  const bool any = std::any_of(factors.begin(), factors.end(), [](const quant::LowRankFactors& f) { return !f.empty(); });
  if (any) {
    for (const quant::LowRankFactors& f : factors) AppendPadded(f, lowrank, h);
  }
  return h;
}

absl::StatusOr<kernels::NqProjection> Upload(const HostProjection& h, int64_t experts,
                                             const format::RecordLayout& layout, const std::string& projection,
                                             int64_t lowrank, kernels::Backend& backend, int64_t& bytes) {
  kernels::NqProjection p;
  ASSIGN_OR_RETURN(p.base, backend.Allocate(kernels::DType::kU8, kernels::Shape{experts, kernels::NqPlaneBytes(h.rows, h.cols)}));
  RETURN_IF_ERROR(backend.CopyFromHost(std::as_bytes(std::span<const uint8_t>(h.base)), p.base));
  ASSIGN_OR_RETURN(p.row_scales, kernels::UploadFloats(backend, h.row_scales, kernels::DType::kF32, {experts, h.rows}));
  ASSIGN_OR_RETURN(p.col_scales, kernels::UploadFloats(backend, h.col_scales, kernels::DType::kF32, {experts, h.cols}));
  if (h.gains.empty()) {
    ASSIGN_OR_RETURN(p.levels, kernels::UploadFloats(backend, h.levels, kernels::DType::kF32, {experts, kernels::kNqLevelTable}));
  } else {
    ASSIGN_OR_RETURN(p.gains, kernels::UploadFloats(backend, h.gains, kernels::DType::kF32,
                                                    {experts, h.cols / kernels::kNqTrellisBlock, kernels::kNqGainsPerBlock}));
  }
  ASSIGN_OR_RETURN(format::Segment segment, layout.Find(projection + ".residual"));
  if (static_cast<int64_t>(segment.bytes) != kernels::NqPlaneBytes(h.rows, h.cols)) {
    return absl::DataLossError(absl::StrCat(projection, ".residual segment of ", segment.bytes, " bytes, want ",
                                            kernels::NqPlaneBytes(h.rows, h.cols)));
  }
  p.residual_offset = static_cast<int64_t>(segment.offset);
  // The factor segment exists exactly where some expert's resident file carries factors (the
  // encoder's rule): either without the other would leave one level's correction unapplied.
  absl::StatusOr<format::Segment> factors = layout.Find(LowRankSegment(projection));
  if (h.lowrank_u.empty() != !factors.ok()) {
    return absl::DataLossError(absl::StrCat(projection, ": ", h.lowrank_u.empty() ? "no resident" : "resident",
                                            " low-rank factors but ", factors.ok() ? "a" : "no", " '",
                                            LowRankSegment(projection), "' record segment"));
  }
  if (!h.lowrank_u.empty()) {
    if (static_cast<int64_t>(factors->bytes) != kernels::NqLowRankBytes(h.rows, h.cols, lowrank)) {
      return absl::DataLossError(absl::StrCat(LowRankSegment(projection), " segment of ", factors->bytes,
                                              " bytes, want ", kernels::NqLowRankBytes(h.rows, h.cols, lowrank)));
    }
    ASSIGN_OR_RETURN(p.lowrank_u, kernels::UploadFloats(backend, h.lowrank_u, kernels::DType::kF32, {experts, h.rows, lowrank}));
    ASSIGN_OR_RETURN(p.lowrank_v, kernels::UploadFloats(backend, h.lowrank_v, kernels::DType::kF32, {experts, lowrank, h.cols}));
    p.lowrank_offset = static_cast<int64_t>(factors->offset);
    bytes += static_cast<int64_t>(p.lowrank_u.nbytes() + p.lowrank_v.nbytes());
  }
  const kernels::Tensor& tables = h.gains.empty() ? p.levels : p.gains;
  bytes += static_cast<int64_t>(p.base.nbytes() + p.row_scales.nbytes() + p.col_scales.nbytes() + tables.nbytes());
  return p;
}

absl::StatusOr<kernels::NqRotation> Rotation(uint64_t seed, int64_t n, int64_t block, kernels::Backend& backend,
                                             int64_t& bytes) {
  kernels::NqRotation r;
  ASSIGN_OR_RETURN(r.signs, kernels::UploadFloats(backend, quant::RandomSigns(seed, n), kernels::DType::kF32, {n}));
  r.block = block;
  bytes += static_cast<int64_t>(r.signs.nbytes());
  return r;
}

}  // namespace

absl::StatusOr<model::PackedExperts> LoadPackedExperts(const ReleaseExpertDecoder& decoder, uint32_t layer,
                                                       kernels::Backend& backend) {
  const std::string& codec = decoder.release().manifest().codec;
  ASSIGN_OR_RETURN(const kernels::NqCodec packed_codec, PackedCodec(codec));
  const uint32_t E = decoder.release().manifest().experts_per_layer;
  ASSIGN_OR_RETURN(const format::LayerEntry* entry, decoder.Layer(layer));
  ASSIGN_OR_RETURN(const model::SafetensorsFile* resident, decoder.Resident(layer));
  const int lowrank = decoder.lowrank_max_rank();
  ASSIGN_OR_RETURN(HostProjection gate, ReadProjection(*resident, codec, E, "gate_proj", lowrank));
  ASSIGN_OR_RETURN(HostProjection up, ReadProjection(*resident, codec, E, "up_proj", lowrank));
  ASSIGN_OR_RETURN(HostProjection down, ReadProjection(*resident, codec, E, "down_proj", lowrank));
  const bool corrected = !gate.lowrank_u.empty() || !up.lowrank_u.empty() || !down.lowrank_u.empty();
  if (corrected && !backend.AppliesNqLowRank()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " of release ", decoder.release().dir(), " has experts with low-rank corrections (issue #16), which the ",
        std::string(backend.name()), " backend's NqMoe kernels do not apply yet: serve it with --backend cpu, or re-encode without ",
        "--lowrank_rank"));
  }
  const quant::RotationParams& g = gate.rotation;
  const quant::RotationParams& u = up.rotation;
  if (up.rows != gate.rows || up.cols != gate.cols || u.row_block != g.row_block || u.col_block != g.col_block ||
      u.row_sign_seed != g.row_sign_seed || u.col_sign_seed != g.col_sign_seed || down.rows != gate.cols ||
      down.cols != gate.rows) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", layer, ": gate/up/down shapes or rotations disagree (",
                                                      gate.rows, "x", gate.cols, ", ", up.rows, "x", up.cols, ", ",
                                                      down.rows, "x", down.cols, ")"));
  }
  model::PackedExperts packed;
  kernels::NqMoeWeights& w = packed.weights;
  w.codec = packed_codec;
  w.hidden = gate.cols;
  w.intermediate = gate.rows;
  w.num_experts = E;
  int64_t& bytes = packed.packed_bytes;
  w.lowrank_rank = corrected ? lowrank : 0;
  ASSIGN_OR_RETURN(w.gate, Upload(gate, E, entry->layout, "gate_proj", lowrank, backend, bytes));
  ASSIGN_OR_RETURN(w.up, Upload(up, E, entry->layout, "up_proj", lowrank, backend, bytes));
  ASSIGN_OR_RETURN(w.down, Upload(down, E, entry->layout, "down_proj", lowrank, backend, bytes));
  ASSIGN_OR_RETURN(w.input, Rotation(g.col_sign_seed, w.hidden, g.col_block, backend, bytes));
  ASSIGN_OR_RETURN(w.gate_rows, Rotation(g.row_sign_seed, w.intermediate, g.row_block, backend, bytes));
  ASSIGN_OR_RETURN(w.down_cols, Rotation(down.rotation.col_sign_seed, w.intermediate, down.rotation.col_block, backend, bytes));
  ASSIGN_OR_RETURN(w.down_rows, Rotation(down.rotation.row_sign_seed, w.hidden, down.rotation.row_block, backend, bytes));
  packed.record_bytes = static_cast<int64_t>(entry->layout.rec_bytes);
  return packed;
}

absl::Status AttachRecords(const ReleaseExpertDecoder& decoder, uint32_t layer, std::span<const uint32_t> experts,
                           kernels::Backend& backend, model::PackedExperts& packed) {
  packed.static_slots.assign(static_cast<size_t>(packed.weights.num_experts), -1);
  if (experts.empty()) {
    packed.records = kernels::Tensor();
    return absl::OkStatus();
  }
  const int64_t rec = packed.record_bytes;
  std::vector<std::byte> host(static_cast<size_t>(rec) * experts.size());
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] >= packed.weights.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", experts[i], " of layer ", layer, " out of range"));
    }
    ASSIGN_OR_RETURN(std::vector<std::byte> record, decoder.ReadRecord(layer, experts[i]));
    if (static_cast<int64_t>(record.size()) != rec) {
      return absl::DataLossError(absl::StrCat("record of layer ", layer, " expert ", experts[i], " has ", record.size(),
                                              " bytes, want ", rec));
    }
    std::copy(record.begin(), record.end(), host.begin() + static_cast<int64_t>(i) * rec);
    packed.static_slots[experts[i]] = static_cast<int32_t>(i);
  }
  ASSIGN_OR_RETURN(packed.records, backend.Allocate(kernels::DType::kU8, kernels::Shape{static_cast<int64_t>(host.size())}));
  return backend.CopyFromHost(host, packed.records);
}

}  // namespace nq::release
