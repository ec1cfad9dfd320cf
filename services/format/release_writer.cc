#include "services/format/release_writer.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"

namespace nq::format {
namespace {

namespace fs = std::filesystem;

std::string Join(const std::string& dir, const std::string& relative) {
  return (fs::path(dir) / relative).string();
}

}  // namespace

RankIndex EmptyRankIndex(const Manifest& manifest, uint32_t rank) {
  RankIndex index;
  index.format = kFormatName;
  index.version = kFormatVersion;
  index.rank = rank;
  index.experts_per_layer = manifest.experts_per_layer;
  return index;
}

absl::StatusOr<bool> LayerFilesMatch(const std::string& dir, const LayerEntry& entry) {
  for (const FileRange* range : {&entry.records, &entry.resident}) {
    const std::string path = Join(dir, range->file);
    if (!FileExists(path)) return false;
    ASSIGN_OR_RETURN(uint64_t size, FileSize(path));
    if (size < range->offset + range->bytes) return false;
    if (range->whole_file() && size != range->bytes) return false;
    ASSIGN_OR_RETURN(std::string sha, Sha256FileRange(path, range->offset, range->bytes));
    if (sha != range->sha256) return false;
  }
  return true;
}

absl::StatusOr<std::vector<CompleteEntry>> CompleteEntries(const std::string& dir,
                                                           const std::vector<RankIndex>& indexes) {
  std::vector<CompleteEntry> entries;
  ASSIGN_OR_RETURN(std::string manifest_sha, Sha256File(Join(dir, kManifestFile)));
  entries.push_back({kManifestFile, manifest_sha});
  for (const RankIndex& index : indexes) {
    const std::string file = RankIndexFile(index.rank);
    ASSIGN_OR_RETURN(std::string sha, Sha256File(Join(dir, file)));
    entries.push_back({file, sha});
    for (const LayerEntry& e : index.layers) {
      // Our layout gives every layer its own record file, so a record range is the whole
      // file and its sha256 is the file's.
      if (e.records.offset != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(RankIndexFile(index.rank), ": layer ", e.layer,
                         " records do not start their file; COMPLETE lists whole files"));
      }
      entries.push_back({e.records.file, e.records.sha256});
      entries.push_back({e.resident.file, e.resident.sha256});
    }
  }
  return entries;
}

absl::StatusOr<ReleaseWriter> ReleaseWriter::Create(std::string dir, Manifest manifest) {
  RETURN_IF_ERROR(manifest.Validate());
  RETURN_IF_ERROR(MakeDirs(dir));
  const std::string manifest_path = Join(dir, kManifestFile);
  std::vector<RankIndex> indexes;
  if (FileExists(manifest_path)) {
    auto existing = ReadManifest(dir);
    if (!existing.ok() || !(*existing == manifest)) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, " already holds a release with another manifest",
                       existing.ok() ? "" : absl::StrCat(" (", existing.status().message(), ")"),
                       "; write into an empty directory"));
    }
  }
  // From here on the directory is being modified: it is not a complete release.
  RETURN_IF_ERROR(RemoveFile(Join(dir, kCompleteFile)));
  RETURN_IF_ERROR(WriteFileAtomic(manifest_path, SerializeManifest(manifest)));
  for (uint32_t r = 0; r < manifest.tp_size; ++r) {
    if (FileExists(Join(dir, RankIndexFile(r)))) {
      ASSIGN_OR_RETURN(RankIndex index, ReadRankIndex(dir, r));
      if (index.experts_per_layer != manifest.experts_per_layer) {
        return absl::FailedPreconditionError(
            absl::StrCat(Join(dir, RankIndexFile(r)), " disagrees with the manifest"));
      }
      indexes.push_back(std::move(index));
    } else {
      indexes.push_back(EmptyRankIndex(manifest, r));
    }
  }
  return ReleaseWriter(std::move(dir), std::move(manifest), std::move(indexes));
}

std::string ReleaseWriter::Path(const std::string& relative) const { return Join(dir_, relative); }

absl::Status ReleaseWriter::CheckRankLayer(uint32_t rank, uint32_t layer) const {
  if (rank >= manifest_.tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the release's tp_size ", manifest_.tp_size));
  }
  if (manifest_.FindLayer(layer) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not in the manifest"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ReleaseWriter::HasLayer(uint32_t rank, uint32_t layer) const {
  RETURN_IF_ERROR(CheckRankLayer(rank, layer));
  const LayerEntry* entry = indexes_[rank].FindLayer(layer);
  if (entry == nullptr) return false;
  return LayerFilesMatch(dir_, *entry);
}

absl::Status ReleaseWriter::WriteLayer(uint32_t rank, uint32_t layer, const RecordLayout& layout,
                                       std::span<const std::vector<std::byte>> records,
                                       const model::SafetensorsWriter& resident) {
  RETURN_IF_ERROR(CheckRankLayer(rank, layer));
  RETURN_IF_ERROR(layout.Validate());
  if (records.size() != manifest_.experts_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " rank ", rank, ": ",
                                                   records.size(), " records, the manifest has ",
                                                   manifest_.experts_per_layer, " experts"));
  }
  std::vector<std::byte> blob;
  blob.reserve(records.size() * layout.rec_bytes);
  for (size_t e = 0; e < records.size(); ++e) {
    if (records[e].size() != layout.rec_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " rank ", rank, " expert ", e,
                                                     ": record has ", records[e].size(),
                                                     " bytes, rec_bytes is ", layout.rec_bytes));
    }
    blob.insert(blob.end(), records[e].begin(), records[e].end());
  }
  ASSIGN_OR_RETURN(std::string resident_bytes, resident.Serialize());

  LayerEntry entry;
  entry.layer = layer;
  entry.layout = layout;
  entry.records = {RecordFile(rank, layer), 0, blob.size(), Sha256Hex(blob)};
  for (const std::vector<std::byte>& record : records) {
    entry.record_sha256.push_back(Sha256Hex(record));
    entry.record_xxh3.push_back(Xxh3Hex(record));
  }
  entry.resident = {ResidentFile(rank, layer), 0, resident_bytes.size(), Sha256Hex(resident_bytes)};

  RankIndex& index = indexes_[rank];
  const LayerEntry* existing = index.FindLayer(layer);
  if (existing != nullptr && *existing == entry) {
    ASSIGN_OR_RETURN(bool match, LayerFilesMatch(dir_, entry));
    if (match) return absl::OkStatus();
  }
  RETURN_IF_ERROR(MakeDirs(fs::path(Path(entry.records.file)).parent_path().string()));
  RETURN_IF_ERROR(MakeDirs(fs::path(Path(entry.resident.file)).parent_path().string()));
  RETURN_IF_ERROR(WriteFileAtomic(Path(entry.records.file), blob));
  RETURN_IF_ERROR(WriteFileAtomic(Path(entry.resident.file), resident_bytes));
  index.Upsert(std::move(entry));
  RETURN_IF_ERROR(index.Validate());
  return WriteFileAtomic(Path(RankIndexFile(rank)), SerializeRankIndex(index));
}

absl::Status ReleaseWriter::Finish() {
  for (uint32_t r = 0; r < manifest_.tp_size; ++r) {
    for (const ManifestLayer& l : manifest_.layers) {
      if (indexes_[r].FindLayer(l.layer) == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot finish ", dir_, ": layer ", l.layer, " of rank ", r, " has not been written"));
      }
    }
    // Rewritten even when no layer changed, so every rank has an index on disk.
    RETURN_IF_ERROR(WriteFileAtomic(Path(RankIndexFile(r)), SerializeRankIndex(indexes_[r])));
  }
  RETURN_IF_ERROR(WriteFileAtomic(Path(kManifestFile), SerializeManifest(manifest_)));
  ASSIGN_OR_RETURN(std::vector<CompleteEntry> entries, CompleteEntries(dir_, indexes_));
  return WriteFileAtomic(Path(kCompleteFile), SerializeComplete(std::move(entries)));
}

}  // namespace nq::format
