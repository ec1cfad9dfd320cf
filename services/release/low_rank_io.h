// Where a release keeps its experts' low-rank corrections (services/quant/low_rank.h, issue #16):
//   manifest.json   codec.params.lowrank = {"max_rank", "dtype": "F16", "domain": "rotated", ...},
//                   and format version 3 (format::kLowRankFormatVersion);
//   resident file   experts.E.PROJ.lowrank_u F16 [rows, rank] and .lowrank_v F16 [rank, cols],
//                   only for the matrices that carry a correction: its rank is the tensors';
//   record          segment "PROJ.lowrank" after the residual planes, in every record of a layer
//                   where some expert's PROJ carries one: the residual level's factors as
//                   quant::PackLowRank stores them at max_rank, all zero for an expert without.
// A release without corrections has none of these and reads as before.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "services/format/manifest.h"
#include "services/format/record_layout.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"
#include "services/quant/low_rank.h"

namespace nq::release {

// The record segment of `projection`'s residual-level factors.
std::string LowRankSegment(const std::string& projection);

// The manifest's codec.params.lowrank for corrections of at most `max_rank`.
nlohmann::json LowRankManifestParams(int max_rank, double outlier_threshold, double min_gain);
// The release's max_rank: 0 without corrections. DataLoss for a malformed entry.
absl::StatusOr<int> ReleaseLowRank(const format::Manifest& manifest);

// Adds `key`.lowrank_u / .lowrank_v (F16) for a non-empty correction's base factors.
absl::Status AddResidentFactors(model::SafetensorsWriter& resident, const std::string& key,
                                const quant::LowRankFactors& base);
// The base factors of (expert, projection), rank 0 when the resident file holds none. DataLoss for
// one tensor without the other, a rank above max_rank, shapes other than rows x cols, a dtype other
// than F16 or non-finite values.
absl::StatusOr<quant::LowRankFactors> LoadResidentFactors(const model::SafetensorsFile& resident, uint32_t expert,
                                                          const std::string& projection, int64_t rows, int64_t cols,
                                                          int max_rank);
// The residual-level factors of `projection` from one record (a release read or a slot) for an
// expert whose base factors have rank `rank`: rank 0 without a segment or with an all-zero one.
// DataLoss for a missing segment where the expert has a correction, a segment of the wrong size
// or non-zero bytes past the expert's rank.
absl::StatusOr<quant::LowRankFactors> LoadRecordFactors(const format::RecordLayout& layout,
                                                        std::span<const std::byte> record,
                                                        const std::string& projection, int64_t rows, int64_t cols,
                                                        int rank, int max_rank);

}  // namespace nq::release
