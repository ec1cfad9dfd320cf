#include "services/format/record_layout.h"

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/format/json_fields.h"

namespace nq::format {

absl::StatusOr<RecordLayout> RecordLayout::Build(std::span<const SegmentSpec> specs) {
  if (specs.empty()) return absl::InvalidArgumentError("a record layout needs a segment");
  RecordLayout layout;
  uint64_t end = 0;
  for (const SegmentSpec& spec : specs) {
    if (spec.bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat("segment '", spec.name, "' is empty"));
    }
    const uint64_t offset = AlignUp(end, kSegmentAlign);
    layout.segments.push_back({spec.name, offset, spec.bytes});
    end = offset + spec.bytes;
  }
  layout.rec_bytes = AlignUp(end, kRecordAlign);
  RETURN_IF_ERROR(layout.Validate());
  return layout;
}

absl::Status RecordLayout::Validate() const {
  if (rec_bytes == 0 || rec_bytes % kRecordAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rec_bytes ", rec_bytes, " is not a positive multiple of ", kRecordAlign));
  }
  if (segments.empty()) return absl::InvalidArgumentError("a record layout needs a segment");
  std::set<std::string> names;
  uint64_t end = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.name.empty())
      return absl::InvalidArgumentError(absl::StrCat("segment ", i, " has no name"));
    if (!names.insert(s.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("segment name '", s.name, "' is repeated"));
    }
    if (s.offset % kSegmentAlign != 0) {
      return absl::InvalidArgumentError(absl::StrCat("segment '", s.name, "' offset ", s.offset,
                                                     " is not a multiple of ", kSegmentAlign));
    }
    if (s.offset < end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment '", s.name, "' at offset ", s.offset, " overlaps the previous segment (ends at ",
          end, "); segments must be in increasing offset order"));
    }
    if (s.bytes > rec_bytes || s.offset > rec_bytes - s.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("segment '", s.name, "' [", s.offset, ", ",
                                                     s.offset + s.bytes, ") exceeds rec_bytes ",
                                                     rec_bytes));
    }
    end = s.offset + s.bytes;
  }
  return absl::OkStatus();
}

absl::StatusOr<Segment> RecordLayout::Find(const std::string& name) const {
  for (const Segment& s : segments) {
    if (s.name == name) return s;
  }
  return absl::NotFoundError(absl::StrCat("the record layout has no segment '", name, "'"));
}

absl::StatusOr<std::vector<std::byte>> RecordLayout::Pack(
    std::span<const std::span<const std::byte>> data) const {
  if (data.size() != segments.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("packing ", data.size(), " segments into a layout of ", segments.size()));
  }
  std::vector<std::byte> record(rec_bytes, std::byte{0});
  for (size_t i = 0; i < segments.size(); ++i) {
    if (data[i].size() != segments[i].bytes) {
      return absl::InvalidArgumentError(absl::StrCat("segment '", segments[i].name, "' has ",
                                                     data[i].size(), " bytes, the layout says ",
                                                     segments[i].bytes));
    }
    std::memcpy(record.data() + segments[i].offset, data[i].data(), data[i].size());
  }
  return record;
}

absl::StatusOr<std::span<const std::byte>> RecordLayout::Unpack(std::span<const std::byte> record,
                                                                const std::string& name) const {
  if (record.size() != rec_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("record has ", record.size(), " bytes, the layout says ", rec_bytes));
  }
  ASSIGN_OR_RETURN(Segment segment, Find(name));
  return record.subspan(segment.offset, segment.bytes);
}

nlohmann::json RecordLayout::ToJson() const {
  nlohmann::json segs = nlohmann::json::array();
  for (const Segment& s : segments) {
    segs.push_back({{"name", s.name}, {"offset", s.offset}, {"bytes", s.bytes}});
  }
  return {{"rec_bytes", rec_bytes}, {"segments", std::move(segs)}};
}

absl::StatusOr<RecordLayout> RecordLayout::FromJson(const nlohmann::json& json,
                                                    const std::string& where) {
  namespace jf = json_fields;
  RecordLayout layout;
  ASSIGN_OR_RETURN(layout.rec_bytes, jf::Uint(json, "rec_bytes", where));
  ASSIGN_OR_RETURN(const nlohmann::json* segs, jf::Array(json, "segments", where));
  for (size_t i = 0; i < segs->size(); ++i) {
    const std::string at = absl::StrCat(where, ".segments[", i, "]");
    Segment s;
    ASSIGN_OR_RETURN(s.name, jf::String((*segs)[i], "name", at));
    ASSIGN_OR_RETURN(s.offset, jf::Uint((*segs)[i], "offset", at));
    ASSIGN_OR_RETURN(s.bytes, jf::Uint((*segs)[i], "bytes", at));
    layout.segments.push_back(std::move(s));
  }
  RETURN_IF_ERROR(Annotate(layout.Validate(), where));
  return layout;
}

}  // namespace nq::format
