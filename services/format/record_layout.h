// The layout of one expert's residual record (DESIGN.md section 5): named segments inside
// a record of rec_bytes, each starting on a kSegmentAlign boundary, rec_bytes a multiple of
// kRecordAlign so O_DIRECT reads land whole. The format is codec-agnostic: segments are
// opaque bytes named by the codec (e.g. "gate_up.residual", "down.scales").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::format {

// Records are read with O_DIRECT: every record is a multiple of the largest logical block
// size we expect on NVMe. Equal to nq::kRecordAlign (services/common/slot_geometry.h),
// repeated here so the format library does not depend on the gRPC-heavy nq_common.
inline constexpr uint64_t kRecordAlign = 4096;
// Segments start on 256-byte boundaries so kernels can read them with aligned vector
// loads (and TMA, which wants 128-byte alignment) straight out of a slot.
inline constexpr uint64_t kSegmentAlign = 256;

struct SegmentSpec {
  std::string name;
  uint64_t bytes = 0;
};

struct Segment {
  std::string name;
  uint64_t offset = 0;
  uint64_t bytes = 0;

  bool operator==(const Segment&) const = default;
};

struct RecordLayout {
  uint64_t rec_bytes = 0;
  std::vector<Segment> segments;  // in increasing offset order

  // Lays `specs` out in order: each at the next kSegmentAlign boundary, rec_bytes rounded
  // up to kRecordAlign. INVALID_ARGUMENT for no segments, an empty or repeated name, or a
  // zero-byte segment.
  static absl::StatusOr<RecordLayout> Build(std::span<const SegmentSpec> specs);

  // INVALID_ARGUMENT naming the first broken rule: rec_bytes a positive multiple of
  // kRecordAlign; names non-empty and unique; offsets on kSegmentAlign boundaries, in
  // increasing order, not overlapping, and inside rec_bytes.
  absl::Status Validate() const;

  // NOT_FOUND when no segment has this name.
  absl::StatusOr<Segment> Find(const std::string& name) const;

  // One record: segment i's bytes at its offset, zeros elsewhere. `data` holds one entry
  // per segment, in layout order, each exactly that segment's size.
  absl::StatusOr<std::vector<std::byte>> Pack(
      std::span<const std::span<const std::byte>> data) const;
  // The bytes of segment `name` inside `record` (a view into it).
  absl::StatusOr<std::span<const std::byte>> Unpack(std::span<const std::byte> record,
                                                    const std::string& name) const;

  nlohmann::json ToJson() const;
  // `where` prefixes error messages ("rank0.json: layers[1].layout").
  static absl::StatusOr<RecordLayout> FromJson(const nlohmann::json& json,
                                               const std::string& where);

  bool operator==(const RecordLayout&) const = default;
};

inline uint64_t AlignUp(uint64_t value, uint64_t align) {
  return (value + align - 1) / align * align;
}

}  // namespace nq::format
