// Reading a NestQuant release (DESIGN.md section 5), for the streamer, the workers and
// nq verify. Open refuses a directory without COMPLETE and checks that every listed file
// is there with the right size; hashing every byte is on demand (Verify), since a release
// holds hundreds of GiB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/common/progress.h"
#include "services/format/manifest.h"
#include "services/format/rank_index.h"

namespace nq::format {

// One file (or range) of a release whose bytes are not what the release says.
struct Difference {
  std::optional<uint32_t> rank;   // absent for manifest.json
  std::optional<uint32_t> layer;  // absent for manifest.json and rank{r}.json
  std::string file;               // relative to the release directory
  std::string problem;            // "sha256 differs", "missing", "truncated: ..."

  bool operator==(const Difference&) const = default;
};

struct VerifyReport {
  std::vector<Difference> differences;

  bool ok() const { return differences.empty(); }
  // One line per difference: "rank 1 layer 4 rank1/L4.bin: sha256 differs".
  std::string ToString() const;
};

struct OpenOptions {
  // Check at Open that every file exists and is long enough (DATA_LOSS otherwise). nq
  // verify turns it off so a short file shows up in its report instead.
  bool check_sizes = true;
};

class Release {
 public:
  // FAILED_PRECONDITION naming COMPLETE when the directory lacks it; INVALID_ARGUMENT for
  // a malformed manifest, index or COMPLETE; DATA_LOSS when an index disagrees with the
  // manifest or COMPLETE, or (check_sizes) a file is missing or short.
  static absl::StatusOr<Release> Open(const std::string& dir, OpenOptions options = {});

  const std::string& dir() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }
  const std::vector<RankIndex>& indexes() const { return indexes_; }
  const std::vector<CompleteEntry>& complete() const { return complete_; }
  // Names this release across services: the sha256 of its manifest.json (from COMPLETE).
  std::string id() const;

  // FAILED_PRECONDITION, naming the release and every mismatching field, when the release
  // was not made for this model.
  absl::Status CheckMatchesModel(const ModelIdentity& model) const;

  // NOT_FOUND for a rank or layer the release does not hold.
  absl::StatusOr<const LayerEntry*> Layer(uint32_t rank, uint32_t layer) const;
  // Absolute paths of a layer's files.
  absl::StatusOr<std::string> RecordPath(uint32_t rank, uint32_t layer) const;
  absl::StatusOr<std::string> ResidentPath(uint32_t rank, uint32_t layer) const;
  // Expert `expert`'s record (layout.rec_bytes) read with pread; `out` must be exactly
  // rec_bytes long.
  absl::Status ReadRecordInto(uint32_t rank, uint32_t layer, uint32_t expert,
                              std::span<std::byte> out) const;
  absl::StatusOr<std::vector<std::byte>> ReadRecord(uint32_t rank, uint32_t layer,
                                                    uint32_t expert) const;
  // OK when `bytes` match expert `expert`'s checksum in the rank index: its XXH3-128 where the
  // index has them, else its SHA-256. DATA_LOSS naming the record and the checksum otherwise;
  // NOT_FOUND as Layer; OUT_OF_RANGE for an expert past the layer's.
  absl::Status CheckRecord(uint32_t rank, uint32_t layer, uint32_t expert, std::span<const std::byte> bytes) const;

  // Hashes manifest.json and the rank indexes against COMPLETE and every record range and
  // resident file against its index. A file that cannot be read is a difference, not an
  // error.
  // `progress` (may be empty) hears after each (rank, layer): bytes hashed as the work.
  VerifyReport Verify(const std::function<void(const ProgressState&)>& progress = {}) const;
  // What serving rank `rank` trusts at load: manifest.json and the rank indexes against
  // COMPLETE, and every resident file of the rank against its index (hashed whole, on up to
  // `threads` threads). Record files are left to the streamer, which checks every record it
  // reads against its checksum in the index before it can become READY.
  VerifyReport VerifyForServing(uint32_t rank, int threads) const;
  // manifest.json and the rank indexes against COMPLETE: small files, hashed in full. What
  // the streamer trusts its per-record checksums from.
  VerifyReport VerifyListedFiles() const;

 private:
  std::string Path(const std::string& relative) const;

  std::string dir_;
  Manifest manifest_;
  std::vector<RankIndex> indexes_;  // indexes_[r] is rank r's
  std::vector<CompleteEntry> complete_;
};

}  // namespace nq::format
