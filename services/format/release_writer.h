// Writes a NestQuant release directory (DESIGN.md section 5), the back end of nq encode.
//
//   ASSIGN_OR_RETURN(auto writer, ReleaseWriter::Create(dir, manifest));
//   for each layer L, rank r:
//     if (writer.HasLayer(r, L)) continue;          // resumed run: already written
//     writer.WriteLayer(r, L, layout, records, resident);
//   writer.Finish();                                // rank indexes, manifest, COMPLETE
//
// Every file is written atomically (tmp + fsync + rename + fsync of the directory), and
// rank{r}.json is rewritten after each layer, so it doubles as the journal of a run: an
// interrupted encode, rerun with the same manifest, skips every layer whose files still
// hash to what the index says. COMPLETE is removed when a run starts and written last.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/format/manifest.h"
#include "services/format/rank_index.h"
#include "services/format/record_layout.h"
#include "services/model/safetensors_writer.h"

namespace nq::format {

class ReleaseWriter {
 public:
  // Validates `manifest`, creates `dir`, removes a stale COMPLETE, writes manifest.json and
  // loads the rank indexes a previous run left. FAILED_PRECONDITION when `dir` already holds
  // a release of a different manifest (its layers could not be reused).
  static absl::StatusOr<ReleaseWriter> Create(std::string dir, Manifest manifest);

  // True when rank `rank`'s index lists `layer` and both its files hash to the index.
  absl::StatusOr<bool> HasLayer(uint32_t rank, uint32_t layer) const;

  // Writes layer `layer` of rank `rank`: `records` holds one record per expert, each
  // layout.rec_bytes long (see RecordLayout::Pack), written back to back to
  // rank{r}/L{L}.bin; `resident` becomes res/rank{r}/L{L}.safetensors. Then rewrites
  // rank{r}.json. A layer already on disk with identical bytes is left untouched.
  absl::Status WriteLayer(uint32_t rank, uint32_t layer, const RecordLayout& layout,
                          std::span<const std::vector<std::byte>> records,
                          const model::SafetensorsWriter& resident);

  // FAILED_PRECONDITION naming the first (rank, layer) not yet written; otherwise writes
  // COMPLETE listing manifest.json, every rank index and every layer file with its sha256.
  absl::Status Finish();

  const std::string& dir() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }

 private:
  ReleaseWriter(std::string dir, Manifest manifest, std::vector<RankIndex> indexes)
      : dir_(std::move(dir)), manifest_(std::move(manifest)), indexes_(std::move(indexes)) {}

  absl::Status CheckRankLayer(uint32_t rank, uint32_t layer) const;
  std::string Path(const std::string& relative) const;

  std::string dir_;
  Manifest manifest_;
  std::vector<RankIndex> indexes_;  // one per rank
};

// An empty index for `rank` of a release with `manifest`.
RankIndex EmptyRankIndex(const Manifest& manifest, uint32_t rank);
// True when both files of `entry` exist under `dir` and hash to what `entry` says.
absl::StatusOr<bool> LayerFilesMatch(const std::string& dir, const LayerEntry& entry);
// COMPLETE's entries for a release whose manifest and indexes are on disk under `dir`:
// manifest.json and each rank{r}.json hashed now, the layer files from the indexes.
absl::StatusOr<std::vector<CompleteEntry>> CompleteEntries(const std::string& dir,
                                                           const std::vector<RankIndex>& indexes);

}  // namespace nq::format
