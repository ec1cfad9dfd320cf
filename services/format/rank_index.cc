#include "services/format/rank_index.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/format/json_fields.h"
#include "services/format/manifest.h"

namespace nq::format {
namespace {

namespace jf = json_fields;
using Json = nlohmann::json;

bool IsLowerHex(const std::string& s, size_t digits) {
  return s.size() == digits && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}
bool IsSha256Hex(const std::string& s) { return IsLowerHex(s, 64); }

// The largest byte offset a range may reach (offset + bytes): off_t's, as pread takes it.
// Validate refuses a range past it, so offset + bytes never wraps around uint64 (a crafted
// offset near 2^64 would otherwise end "before" any file's size and pass the size check).
constexpr uint64_t kMaxFileOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// A relative path inside the release: no absolute paths, no "..".
bool IsSafeRelativePath(const std::string& p) {
  if (p.empty() || p.front() == '/') return false;
  for (const auto& part : std::filesystem::path(p)) {
    if (part == "..") return false;
  }
  return true;
}

absl::Status ValidateRange(const FileRange& r, const std::string& where) {
  if (!IsSafeRelativePath(r.file)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".file '", r.file, "' is not a relative path inside the release"));
  }
  if (!IsSha256Hex(r.sha256)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".sha256 must be 64 lower-case hex digits"));
  }
  if (r.offset > kMaxFileOffset || r.bytes > kMaxFileOffset - r.offset) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": offset ", r.offset, " + bytes ", r.bytes, " of ", r.file,
                                                   " is past the largest file offset ", kMaxFileOffset));
  }
  return absl::OkStatus();
}

Json RangeToJson(const FileRange& r, bool with_offset) {
  Json j = {{"file", r.file}, {"bytes", r.bytes}, {"sha256", r.sha256}};
  if (with_offset) j["offset"] = r.offset;
  return j;
}

absl::StatusOr<FileRange> RangeFromJson(const Json& obj, const std::string& key,
                                        const std::string& where, bool with_offset) {
  ASSIGN_OR_RETURN(const Json* j, jf::Object(obj, key, where));
  const std::string at = where + "." + key;
  FileRange r;
  ASSIGN_OR_RETURN(r.file, jf::String(*j, "file", at));
  if (with_offset) {
    ASSIGN_OR_RETURN(r.offset, jf::Uint(*j, "offset", at));
  }
  ASSIGN_OR_RETURN(r.bytes, jf::Uint(*j, "bytes", at));
  ASSIGN_OR_RETURN(r.sha256, jf::String(*j, "sha256", at));
  return r;
}

}  // namespace

std::string RankIndexFile(uint32_t rank) { return absl::StrCat("rank", rank, ".json"); }
std::string RecordFile(uint32_t rank, uint32_t layer) {
  return absl::StrCat("rank", rank, "/L", layer, ".bin");
}
std::string ResidentFile(uint32_t rank, uint32_t layer) {
  return absl::StrCat("res/rank", rank, "/L", layer, ".safetensors");
}

absl::Status RankIndex::Validate() const {
  const std::string file = RankIndexFile(rank);
  if (format != kFormatName) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": format is '", format, "', expected '", kFormatName, "'"));
  }
  if (version != kFormatVersion) {
    return absl::InvalidArgumentError(UnsupportedVersionMessage(file, version));
  }
  if (experts_per_layer == 0) {
    return absl::InvalidArgumentError(file + ": experts_per_layer must be positive");
  }
  // Record ranges per file, to find overlaps: file -> (offset -> (end, layer)).
  std::map<std::string, std::map<uint64_t, std::pair<uint64_t, uint32_t>>> ranges;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerEntry& e = layers[i];
    const std::string where = absl::StrCat(file, ": layer ", e.layer);
    if (i > 0 && e.layer <= layers[i - 1].layer) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": layers must be strictly increasing (",
                                                     layers[i - 1].layer, " then ", e.layer, ")"));
    }
    RETURN_IF_ERROR(Annotate(e.layout.Validate(), where + " layout"));
    RETURN_IF_ERROR(ValidateRange(e.records, where + " records"));
    RETURN_IF_ERROR(ValidateRange(e.resident, where + " resident"));
    if (e.records.offset % kRecordAlign != 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": records offset ", e.records.offset,
                                                     " is not a multiple of ", kRecordAlign));
    }
    uint64_t expected_bytes = 0;
    if (__builtin_mul_overflow(uint64_t{experts_per_layer}, e.layout.rec_bytes, &expected_bytes) ||
        e.records.bytes != expected_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": records bytes ", e.records.bytes,
                                                     " != ", experts_per_layer,
                                                     " experts x rec_bytes ", e.layout.rec_bytes));
    }
    if (e.record_sha256.size() != experts_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", e.record_sha256.size(),
                                                     " record_sha256 entries for ", experts_per_layer, " experts"));
    }
    for (size_t x = 0; x < e.record_sha256.size(); ++x) {
      if (!IsSha256Hex(e.record_sha256[x])) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": record_sha256[", x, "] must be 64 lower-case hex digits"));
      }
    }
    if (!e.record_xxh3.empty() && e.record_xxh3.size() != experts_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", e.record_xxh3.size(),
                                                     " record_xxh3 entries for ", experts_per_layer, " experts"));
    }
    for (size_t x = 0; x < e.record_xxh3.size(); ++x) {
      if (!IsLowerHex(e.record_xxh3[x], 32)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": record_xxh3[", x, "] must be 32 lower-case hex digits"));
      }
    }
    if (e.resident.offset != 0) {
      return absl::InvalidArgumentError(where + ": a resident file is a whole file (offset 0)");
    }
    auto& in_file = ranges[e.records.file];
    const uint64_t begin = e.records.offset, end = e.records.offset + e.records.bytes;
    auto next = in_file.lower_bound(begin);
    if (next != in_file.end() && next->first < end) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": records overlap those of layer ",
                                                     next->second.second, " in ", e.records.file));
    }
    if (next != in_file.begin() && std::prev(next)->second.first > begin) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": records overlap those of layer ",
                                                     std::prev(next)->second.second, " in ",
                                                     e.records.file));
    }
    in_file.emplace(begin, std::make_pair(end, e.layer));
  }
  return absl::OkStatus();
}

const LayerEntry* RankIndex::FindLayer(uint32_t layer) const {
  for (const LayerEntry& e : layers) {
    if (e.layer == layer) return &e;
  }
  return nullptr;
}

void RankIndex::Upsert(LayerEntry entry) {
  auto it = std::lower_bound(layers.begin(), layers.end(), entry.layer,
                             [](const LayerEntry& e, uint32_t l) { return e.layer < l; });
  if (it != layers.end() && it->layer == entry.layer) {
    *it = std::move(entry);
  } else {
    layers.insert(it, std::move(entry));
  }
}

bool RankIndex::Remove(uint32_t layer) {
  auto it = std::find_if(layers.begin(), layers.end(),
                         [layer](const LayerEntry& e) { return e.layer == layer; });
  if (it == layers.end()) return false;
  layers.erase(it);
  return true;
}

RecordDigest ExpectedRecordDigest(const LayerEntry& entry, uint32_t expert, bool sha256_only) {
  if (!sha256_only && !entry.record_xxh3.empty()) {
    return {.kind = RecordDigest::Kind::kXxh3, .hex = entry.record_xxh3.at(expert)};
  }
  return {.kind = RecordDigest::Kind::kSha256, .hex = entry.record_sha256.at(expert)};
}

bool RecordMatches(std::span<const std::byte> bytes, const RecordDigest& expected) {
  return (expected.kind == RecordDigest::Kind::kXxh3 ? Xxh3Hex(bytes) : Sha256Hex(bytes)) == expected.hex;
}

std::string SerializeRankIndex(const RankIndex& index) {
  Json layers = Json::array();
  for (const LayerEntry& e : index.layers) {
    Json layer = {{"layer", e.layer},
                  {"records", RangeToJson(e.records, /*with_offset=*/true)},
                  {"record_sha256", e.record_sha256},
                  {"resident", RangeToJson(e.resident, /*with_offset=*/false)},
                  {"layout", e.layout.ToJson()}};
    if (!e.record_xxh3.empty()) layer["record_xxh3"] = e.record_xxh3;
    layers.push_back(std::move(layer));
  }
  Json json = {{"format", index.format},
               {"version", index.version},
               {"rank", index.rank},
               {"experts_per_layer", index.experts_per_layer},
               {"layers", std::move(layers)}};
  return json.dump(2) + "\n";
}

absl::StatusOr<RankIndex> ParseRankIndex(const std::string& text, const std::string& file) {
  ASSIGN_OR_RETURN(Json json, jf::Parse(text, file));
  RankIndex index;
  ASSIGN_OR_RETURN(index.format, jf::String(json, "format", file));
  ASSIGN_OR_RETURN(index.version, jf::Uint32(json, "version", file));
  ASSIGN_OR_RETURN(index.rank, jf::Uint32(json, "rank", file));
  if (index.format != kFormatName) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": format '", index.format,
                                                   "' is not supported (this build reads '", kFormatName, "')"));
  }
  if (index.version != kFormatVersion) {
    return absl::InvalidArgumentError(UnsupportedVersionMessage(file, index.version));
  }
  ASSIGN_OR_RETURN(index.experts_per_layer, jf::Uint32(json, "experts_per_layer", file));
  ASSIGN_OR_RETURN(const Json* layers, jf::Array(json, "layers", file));
  for (size_t i = 0; i < layers->size(); ++i) {
    const std::string at = absl::StrCat(file, ": layers[", i, "]");
    const Json& lj = (*layers)[i];
    LayerEntry e;
    ASSIGN_OR_RETURN(e.layer, jf::Uint32(lj, "layer", at));
    ASSIGN_OR_RETURN(e.records, RangeFromJson(lj, "records", at, /*with_offset=*/true));
    ASSIGN_OR_RETURN(e.resident, RangeFromJson(lj, "resident", at, /*with_offset=*/false));
    ASSIGN_OR_RETURN(const Json* record_sha, jf::Array(lj, "record_sha256", at));
    for (size_t x = 0; x < record_sha->size(); ++x) {
      if (!(*record_sha)[x].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".record_sha256[", x, "] is not a string"));
      }
      e.record_sha256.push_back((*record_sha)[x].get<std::string>());
    }
    // Optional: releases written before it have none (their records are checked by sha256).
    if (lj.contains("record_xxh3")) {
      ASSIGN_OR_RETURN(const Json* record_xxh3, jf::Array(lj, "record_xxh3", at));
      for (size_t x = 0; x < record_xxh3->size(); ++x) {
        if (!(*record_xxh3)[x].is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(at, ".record_xxh3[", x, "] is not a string"));
        }
        e.record_xxh3.push_back((*record_xxh3)[x].get<std::string>());
      }
    }
    ASSIGN_OR_RETURN(const Json* layout, jf::Object(lj, "layout", at));
    ASSIGN_OR_RETURN(e.layout, RecordLayout::FromJson(*layout, at + ".layout"));
    index.layers.push_back(std::move(e));
  }
  RETURN_IF_ERROR(index.Validate());
  return index;
}

absl::StatusOr<RankIndex> ReadRankIndex(const std::string& release_dir, uint32_t rank) {
  const std::string file = RankIndexFile(rank);
  ASSIGN_OR_RETURN(std::string text,
                   ReadFileToString((std::filesystem::path(release_dir) / file).string()));
  ASSIGN_OR_RETURN(RankIndex index, ParseRankIndex(text, file));
  if (index.rank != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": rank is ", index.rank, ", expected ", rank));
  }
  return index;
}

std::string SerializeComplete(std::vector<CompleteEntry> entries) {
  std::sort(entries.begin(), entries.end(),
            [](const CompleteEntry& a, const CompleteEntry& b) { return a.path < b.path; });
  std::string text;
  for (const CompleteEntry& e : entries) absl::StrAppend(&text, e.sha256, "  ", e.path, "\n");
  return text;
}

absl::StatusOr<std::vector<CompleteEntry>> ParseComplete(const std::string& text) {
  std::vector<CompleteEntry> entries;
  size_t line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    ++line_no;
    const size_t sep = line.find("  ");
    CompleteEntry e;
    if (sep != absl::string_view::npos) {
      e.sha256 = std::string(line.substr(0, sep));
      e.path = std::string(line.substr(sep + 2));
    }
    if (sep == absl::string_view::npos || !IsSha256Hex(e.sha256) || !IsSafeRelativePath(e.path)) {
      return absl::InvalidArgumentError(
          absl::StrCat("COMPLETE line ", line_no, " is not '<sha256>  <relative path>'"));
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace nq::format
