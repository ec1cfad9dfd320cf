#include "services/release/low_rank_io.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/dtype_convert.h"

namespace nq::release {

std::string LowRankSegment(const std::string& projection) { return projection + ".lowrank"; }

nlohmann::json LowRankManifestParams(int max_rank, double outlier_threshold, double min_gain) {
  return {{"max_rank", max_rank},
          {"dtype", "F16"},
          {"domain", "rotated"},
          {"outlier_threshold", outlier_threshold},
          {"min_gain", min_gain}};
}

absl::StatusOr<int> ReleaseLowRank(const format::Manifest& manifest) {
  auto it = manifest.codec_params.find(format::kLowRankParam);
  if (it == manifest.codec_params.end()) return 0;
  const nlohmann::json& p = *it;
  if (!p.is_object() || !p.contains("max_rank") || !p["max_rank"].is_number_integer() ||
      p.value("dtype", "") != "F16" || p.value("domain", "") != "rotated") {
    return absl::DataLossError(absl::StrCat("manifest.json: codec.params.", format::kLowRankParam, " is ", p.dump(),
                                            "; want {\"max_rank\": 1..", quant::kMaxLowRank,
                                            ", \"dtype\": \"F16\", \"domain\": \"rotated\"}"));
  }
  const int64_t rank = p["max_rank"].get<int64_t>();
  if (rank < 1 || rank > quant::kMaxLowRank) {
    return absl::DataLossError(absl::StrCat("manifest.json: low-rank max_rank ", rank, " is outside [1, ",
                                            quant::kMaxLowRank, "]"));
  }
  return static_cast<int>(rank);
}

absl::Status AddResidentFactors(model::SafetensorsWriter& resident, const std::string& key,
                                const quant::LowRankFactors& base) {
  RETURN_IF_ERROR(resident.AddFloat32(key + ".lowrank_u", {base.rows, base.rank}, base.u, model::DType::kF16));
  return resident.AddFloat32(key + ".lowrank_v", {base.rank, base.cols}, base.v, model::DType::kF16);
}

absl::StatusOr<quant::LowRankFactors> LoadResidentFactors(const model::SafetensorsFile& resident, uint32_t expert,
                                                          const std::string& projection, int64_t rows, int64_t cols,
                                                          int max_rank) {
  const std::string key = absl::StrCat("experts.", expert, ".", projection);
  const std::string what = absl::StrCat(resident.path(), ": ", key);
  absl::StatusOr<model::TensorView> u = resident.Find(key + ".lowrank_u");
  absl::StatusOr<model::TensorView> v = resident.Find(key + ".lowrank_v");
  if (!u.ok() && !v.ok() && absl::IsNotFound(u.status()) && absl::IsNotFound(v.status())) {
    return quant::LowRankFactors{.rows = rows, .cols = cols, .rank = 0};
  }
  if (!u.ok() || !v.ok()) {
    return absl::DataLossError(absl::StrCat(what, " has only one of lowrank_u and lowrank_v"));
  }
  if (max_rank == 0) {
    return absl::DataLossError(absl::StrCat(what, " carries a low-rank correction its manifest does not announce"));
  }
  if (u->dtype != model::DType::kF16 || v->dtype != model::DType::kF16 || u->shape.size() != 2 ||
      v->shape.size() != 2 || u->shape[0] != rows || v->shape[1] != cols || u->shape[1] != v->shape[0] ||
      u->shape[1] < 1 || u->shape[1] > max_rank) {
    return absl::DataLossError(absl::StrCat(what, ": low-rank factors are not F16 [", rows, ", r] and [r, ", cols,
                                            "] with 1 <= r <= ", max_rank));
  }
  quant::LowRankFactors f{.rows = rows, .cols = cols, .rank = static_cast<int>(u->shape[1])};
  ASSIGN_OR_RETURN(f.u, model::ConvertToFloat32(u->dtype, u->data));
  ASSIGN_OR_RETURN(f.v, model::ConvertToFloat32(v->dtype, v->data));
  RETURN_IF_ERROR(quant::ValidateLowRank(f, rows, cols, what.c_str()));
  return f;
}

absl::StatusOr<quant::LowRankFactors> LoadRecordFactors(const format::RecordLayout& layout,
                                                        std::span<const std::byte> record,
                                                        const std::string& projection, int64_t rows, int64_t cols,
                                                        int rank, int max_rank) {
  const std::string name = LowRankSegment(projection);
  absl::StatusOr<std::span<const std::byte>> bytes = layout.Unpack(record, name);
  if (!bytes.ok() && absl::IsNotFound(bytes.status())) {
    if (rank == 0) return quant::LowRankFactors{.rows = rows, .cols = cols, .rank = 0};
    return absl::DataLossError(absl::StrCat("the record layout has no '", name, "' segment for an expert whose ",
                                            projection, " carries a rank-", rank, " correction"));
  }
  RETURN_IF_ERROR(bytes.status());
  absl::StatusOr<quant::LowRankFactors> f =
      quant::UnpackLowRank(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()),
                           rows, cols, rank, max_rank);
  if (!f.ok()) return absl::DataLossError(absl::StrCat("record segment '", name, "': ", f.status().message()));
  return f;
}

}  // namespace nq::release
