// rank{r}.json: the index of rank r's files (DESIGN.md section 5). Per layer: where the
// layer's records lie (file, offset, bytes, sha256), its resident file (bytes, sha256),
// and the record layout. Paths are relative to the release directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/format/record_layout.h"

namespace nq::format {

struct FileRange {
  std::string file;  // relative to the release directory
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string sha256;  // lower-case hex of the range

  // A range at offset 0 is its whole file (every range nq encode writes is): the file must
  // be exactly `bytes` long, and COMPLETE's sha256 of the file is the range's.
  bool whole_file() const { return offset == 0; }

  bool operator==(const FileRange&) const = default;
};

struct LayerEntry {
  uint32_t layer = 0;
  FileRange records;   // experts_per_layer records of layout.rec_bytes, back to back
  // sha256 (lower-case hex) of each record, by expert: the streamer checks every record it
  // reads against its entry before the record can become READY (format version 2).
  std::vector<std::string> record_sha256;
  // XXH3-128 (32 lower-case hex digits, Xxh3Hex) of each record, by expert: the check the
  // streamer runs on every read when present (about 9x faster than SHA-256, so it stays off
  // the read path's bandwidth). Empty in releases written before it; those are checked with
  // record_sha256. Either all experts or none.
  std::vector<std::string> record_xxh3;
  FileRange resident;  // a whole safetensors file (offset 0)
  RecordLayout layout;

  bool operator==(const LayerEntry&) const = default;
};

// What one record is checked against: one of its checksums in the index.
struct RecordDigest {
  enum class Kind { kXxh3, kSha256 };
  Kind kind = Kind::kSha256;
  std::string hex;  // lower-case
  // "xxh3" or "sha256", as the index names the field (record_<name>).
  const char* name() const { return kind == Kind::kXxh3 ? "xxh3" : "sha256"; }
};
// Expert `expert`'s checksum in `entry` (expert below its record_sha256's size): its XXH3-128
// where the entry has them and `sha256_only` is false, else its SHA-256.
RecordDigest ExpectedRecordDigest(const LayerEntry& entry, uint32_t expert, bool sha256_only = false);
// Whether `bytes` hash to `expected`.
bool RecordMatches(std::span<const std::byte> bytes, const RecordDigest& expected);

struct RankIndex {
  std::string format;
  uint32_t version = 0;
  uint32_t rank = 0;
  uint32_t experts_per_layer = 0;
  std::vector<LayerEntry> layers;  // strictly increasing layer ids; may be a subset while
                                   // nq assemble installs layers

  // INVALID_ARGUMENT naming the first broken rule: version, increasing layers, record
  // offsets multiples of kRecordAlign, records.bytes == experts_per_layer * rec_bytes,
  // records of two layers in one file not overlapping, resident offset 0, valid layouts,
  // sha256 64 hex digits, one record_sha256 per expert, record_xxh3 empty or one per expert of
  // 32 hex digits.
  absl::Status Validate() const;
  const LayerEntry* FindLayer(uint32_t layer) const;
  // Inserts or replaces the entry for entry.layer, keeping the order.
  void Upsert(LayerEntry entry);
  // Removes the entry for `layer`; false when absent.
  bool Remove(uint32_t layer);

  bool operator==(const RankIndex&) const = default;
};

std::string RankIndexFile(uint32_t rank);                 // "rank3.json"
std::string RecordFile(uint32_t rank, uint32_t layer);    // "rank3/L12.bin"
std::string ResidentFile(uint32_t rank, uint32_t layer);  // "res/rank3/L12.safetensors"

// Deterministic text (sorted keys, 2-space indent, trailing newline).
std::string SerializeRankIndex(const RankIndex& index);
// `file` names the source in errors ("rank0.json").
absl::StatusOr<RankIndex> ParseRankIndex(const std::string& text, const std::string& file);
absl::StatusOr<RankIndex> ReadRankIndex(const std::string& release_dir, uint32_t rank);

// COMPLETE: written last, one line per file, "<sha256>  <relative path>" sorted by path —
// the format of sha256sum, so `sha256sum -c COMPLETE` checks a release too.
inline constexpr char kCompleteFile[] = "COMPLETE";
struct CompleteEntry {
  std::string path;
  std::string sha256;
  bool operator==(const CompleteEntry&) const = default;
};
std::string SerializeComplete(std::vector<CompleteEntry> entries);
absl::StatusOr<std::vector<CompleteEntry>> ParseComplete(const std::string& text);

}  // namespace nq::format
