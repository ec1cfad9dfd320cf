#include "services/format/release_reader.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"

namespace nq::format {
namespace {

namespace fs = std::filesystem;

// "" when the range's file holds at least offset + bytes bytes (exactly `bytes` for a whole
// file), else what is wrong with it.
std::string SizeProblem(const std::string& path, const FileRange& range, bool whole_file) {
  auto size = FileSize(path);
  if (!size.ok())
    return absl::IsNotFound(size.status()) ? "missing" : std::string(size.status().message());
  // RankIndex::Validate keeps offset + bytes from wrapping; compare without the sum anyway,
  // so a range past the end can never pass as inside the file.
  if (*size < range.offset || *size - range.offset < range.bytes) {
    return absl::StrCat("truncated: ", *size, " bytes, the index wants offset ", range.offset, " + ", range.bytes,
                        " bytes");
  }
  if (whole_file && *size != range.bytes) return absl::StrCat("size ", *size, " bytes, expected ", range.bytes);
  return "";
}

// FAILED_PRECONDITION when `relative`, resolved through symlinks, is not inside `dir` (also
// resolved): a release whose rank0/L3.bin links to /etc/shadow, or whose layer directory links
// elsewhere, is refused by name. A file that does not exist resolves lexically, so it is still
// reported as missing by the size checks, not here.
absl::Status CheckInsideRelease(const std::string& dir, const std::string& relative) {
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(fs::path(dir), ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("release ", dir, ": cannot resolve it: ", ec.message()));
  const fs::path target = fs::weakly_canonical(root / relative, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("release ", dir, ": cannot resolve ", relative, ": ", ec.message()));
  }
  const fs::path inside = target.lexically_relative(root);
  if (inside.empty() || inside.is_absolute() || *inside.begin() == "..") {
    return absl::FailedPreconditionError(absl::StrCat("release ", dir, ": ", relative, " resolves to ",
                                                      target.string(), ", outside the release directory"));
  }
  return absl::OkStatus();
}

// HashProblem's answer for a range of the right size whose bytes differ.
constexpr char kHashDiffers[] = "sha256 differs";

// "" when the range hashes to what the index says, else the problem.
std::string HashProblem(const std::string& path, const FileRange& range, bool whole_file) {
  std::string problem = SizeProblem(path, range, whole_file);
  if (!problem.empty()) return problem;
  auto sha = Sha256FileRange(path, range.offset, range.bytes);
  if (!sha.ok()) return std::string(sha.status().message());
  return *sha == range.sha256 ? "" : kHashDiffers;
}

}  // namespace

std::string VerifyReport::ToString() const {
  std::string text;
  for (const Difference& d : differences) {
    if (d.rank.has_value()) absl::StrAppend(&text, "rank ", *d.rank, " ");
    if (d.layer.has_value()) absl::StrAppend(&text, "layer ", *d.layer, " ");
    absl::StrAppend(&text, d.file, ": ", d.problem, "\n");
  }
  return text;
}

std::string Release::Path(const std::string& relative) const {
  return (fs::path(dir_) / relative).string();
}

absl::StatusOr<Release> Release::Open(const std::string& dir, OpenOptions options) {
  Release release;
  release.dir_ = dir;
  const std::string complete_path = release.Path(kCompleteFile);
  if (!FileExists(complete_path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("release ", dir, " has no ", kCompleteFile,
                     " file: it was not completely written (rerun nq encode or nq assemble)"));
  }
  ASSIGN_OR_RETURN(std::string complete_text, ReadFileToString(complete_path));
  auto complete = ParseComplete(complete_text);
  if (!complete.ok()) return Annotate(complete.status(), absl::StrCat("release ", dir));
  release.complete_ = *std::move(complete);
  std::map<std::string, std::string> listed;
  for (const CompleteEntry& e : release.complete_) listed[e.path] = e.sha256;

  // Every file the release names, resolved through any symlinks, must lie inside it: index
  // paths are relative without "..", and this closes the other way out (DESIGN.md section 12).
  RETURN_IF_ERROR(CheckInsideRelease(dir, kCompleteFile));
  for (const CompleteEntry& e : release.complete_) RETURN_IF_ERROR(CheckInsideRelease(dir, e.path));
  ASSIGN_OR_RETURN(release.manifest_, ReadManifest(dir));
  if (!listed.contains(kManifestFile)) {
    return absl::DataLossError(absl::StrCat(dir, ": COMPLETE does not list ", kManifestFile));
  }
  const std::vector<uint32_t> layer_ids = release.manifest_.LayerIds();
  for (uint32_t r = 0; r < release.manifest_.tp_size; ++r) {
    ASSIGN_OR_RETURN(RankIndex index, ReadRankIndex(dir, r));
    const std::string file = RankIndexFile(r);
    if (!listed.contains(file)) {
      return absl::DataLossError(absl::StrCat(dir, ": COMPLETE does not list ", file));
    }
    if (index.experts_per_layer != release.manifest_.experts_per_layer) {
      return absl::DataLossError(absl::StrCat(dir, ": ", file, " has ", index.experts_per_layer,
                                              " experts per layer, the manifest ",
                                              release.manifest_.experts_per_layer));
    }
    std::vector<uint32_t> index_layers;
    for (const LayerEntry& e : index.layers) index_layers.push_back(e.layer);
    if (index_layers != layer_ids) {
      return absl::DataLossError(
          absl::StrCat(dir, ": ", file, " does not list exactly the manifest's layers"));
    }
    for (const LayerEntry& e : index.layers) {
      for (const FileRange* range : {&e.records, &e.resident}) {
        auto it = listed.find(range->file);
        // COMPLETE lists whole files; a range that is its whole file must agree with it.
        if (it == listed.end()) {
          return absl::DataLossError(absl::StrCat(dir, ": COMPLETE does not list ", range->file,
                                                  " (rank ", r, " layer ", e.layer, ")"));
        }
        if (range->offset == 0 && it->second != range->sha256) {
          return absl::DataLossError(absl::StrCat(dir, ": COMPLETE and ", file,
                                                  " disagree on the sha256 of ", range->file));
        }
        if (options.check_sizes) {
          const std::string problem =
              SizeProblem(release.Path(range->file), *range, range->whole_file());
          if (!problem.empty()) {
            return absl::DataLossError(absl::StrCat("release ", dir, " rank ", r, " layer ",
                                                    e.layer, ": ", range->file, " ", problem));
          }
        }
      }
    }
    release.indexes_.push_back(std::move(index));
  }
  return release;
}

absl::Status Release::CheckMatchesModel(const ModelIdentity& model) const {
  return Annotate(CheckManifestMatchesModel(manifest_, model), absl::StrCat("release ", dir_));
}

std::string Release::id() const {
  for (const CompleteEntry& entry : complete_) {
    if (entry.path == kManifestFile) return entry.sha256;
  }
  return "";  // Open refuses a COMPLETE without manifest.json
}

absl::StatusOr<const LayerEntry*> Release::Layer(uint32_t rank, uint32_t layer) const {
  if (rank >= indexes_.size()) {
    return absl::NotFoundError(
        absl::StrCat("release ", dir_, " has ", indexes_.size(), " ranks, not rank ", rank));
  }
  const LayerEntry* entry = indexes_[rank].FindLayer(layer);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("release ", dir_, " has no layer ", layer));
  }
  return entry;
}

absl::StatusOr<std::string> Release::RecordPath(uint32_t rank, uint32_t layer) const {
  ASSIGN_OR_RETURN(const LayerEntry* entry, Layer(rank, layer));
  return Path(entry->records.file);
}

absl::StatusOr<std::string> Release::ResidentPath(uint32_t rank, uint32_t layer) const {
  ASSIGN_OR_RETURN(const LayerEntry* entry, Layer(rank, layer));
  return Path(entry->resident.file);
}

absl::Status Release::ReadRecordInto(uint32_t rank, uint32_t layer, uint32_t expert,
                                     std::span<std::byte> out) const {
  ASSIGN_OR_RETURN(const LayerEntry* entry, Layer(rank, layer));
  if (expert >= manifest_.experts_per_layer) {
    return absl::NotFoundError(
        absl::StrCat("expert ", expert, " is out of range [0, ", manifest_.experts_per_layer, ")"));
  }
  if (out.size() != entry->layout.rec_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "record buffer has ", out.size(), " bytes, rec_bytes is ", entry->layout.rec_bytes));
  }
  const std::string path = Path(entry->records.file);
  ASSIGN_OR_RETURN(Fd fd, OpenForRead(path));
  return PReadAll(fd.get(), entry->records.offset + uint64_t{expert} * entry->layout.rec_bytes, out,
                  path);
}

absl::StatusOr<std::vector<std::byte>> Release::ReadRecord(uint32_t rank, uint32_t layer,
                                                           uint32_t expert) const {
  ASSIGN_OR_RETURN(const LayerEntry* entry, Layer(rank, layer));
  std::vector<std::byte> record(entry->layout.rec_bytes);
  RETURN_IF_ERROR(ReadRecordInto(rank, layer, expert, record));
  return record;
}

absl::Status Release::CheckRecord(uint32_t rank, uint32_t layer, uint32_t expert,
                                  std::span<const std::byte> bytes) const {
  ASSIGN_OR_RETURN(const LayerEntry* entry, Layer(rank, layer));
  if (expert >= entry->record_sha256.size()) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " has ", entry->record_sha256.size(), " experts, not ",
                                              expert + 1));
  }
  const RecordDigest expected = ExpectedRecordDigest(*entry, expert);
  if (RecordMatches(bytes, expected)) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("rank ", rank, " layer ", layer, " expert ", expert, ": the record read from ",
                                          entry->records.file, " does not match its ", expected.name(), " in ",
                                          RankIndexFile(rank)));
}

VerifyReport Release::Verify(const std::function<void(const ProgressState&)>& progress) const {
  VerifyReport report = VerifyListedFiles();
  ProgressState state;
  for (const RankIndex& index : indexes_) state.total += static_cast<int64_t>(index.layers.size());
  for (const RankIndex& index : indexes_) {
    for (const LayerEntry& e : index.layers) {
      state.stage = absl::StrCat("rank ", index.rank, " layer ", e.layer);
      bool records_readable = true;
      for (const FileRange* range : {&e.records, &e.resident}) {
        std::string problem = HashProblem(Path(range->file), *range, range->whole_file());
        if (!problem.empty()) {
          if (range == &e.records && problem != kHashDiffers) records_readable = false;
          report.differences.push_back({index.rank, e.layer, range->file, std::move(problem)});
        }
      }
      // Each record against its own sha256 (what the streamer checks every read against), so a
      // damaged layer names its experts, and an index whose record checksums disagree with
      // records whose file hash matches is caught too. A missing or short file is reported once.
      for (uint32_t expert = 0; records_readable && expert < e.record_sha256.size(); ++expert) {
        absl::StatusOr<std::vector<std::byte>> record = ReadRecord(index.rank, e.layer, expert);
        if (!record.ok()) {
          report.differences.push_back({index.rank, e.layer, e.records.file,
                                        absl::StrCat("expert ", expert, ": ", record.status().message())});
        } else if (Sha256Hex(*record) != e.record_sha256[expert]) {
          report.differences.push_back({index.rank, e.layer, e.records.file,
                                        absl::StrCat("expert ", expert, ": record differs from its sha256 in ",
                                                     RankIndexFile(index.rank))});
        } else if (!e.record_xxh3.empty() && Xxh3Hex(*record) != e.record_xxh3[expert]) {
          // The streamer checks reads against this one: a wrong entry would refuse a good record.
          report.differences.push_back({index.rank, e.layer, e.records.file,
                                        absl::StrCat("expert ", expert, ": record differs from its xxh3 in ",
                                                     RankIndexFile(index.rank))});
        }
      }
      // The records are hashed twice: as a file, then record by record.
      ++state.done;
      state.work += 2.0 * static_cast<double>(e.records.bytes) + static_cast<double>(e.resident.bytes);
      if (progress) progress(state);
    }
  }
  return report;
}

VerifyReport Release::VerifyForServing(uint32_t rank, int threads) const {
  VerifyReport report = VerifyListedFiles();
  const RankIndex* index = nullptr;
  for (const RankIndex& i : indexes_) {
    if (i.rank == rank) index = &i;
  }
  if (index == nullptr) {
    report.differences.push_back({rank, std::nullopt, RankIndexFile(rank), "missing: no index for this rank"});
    return report;
  }
  // Resident files are hashed whole, a layer per thread (SHA-256 runs at 1-2 GB/s a core; a
  // large model's resident bases are tens to hundreds of GB).
  std::vector<std::string> problems(index->layers.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < index->layers.size(); i = next.fetch_add(1)) {
      const FileRange& r = index->layers[i].resident;
      problems[i] = HashProblem(Path(r.file), r, r.whole_file());
    }
  };
  std::vector<std::thread> pool;
  const size_t workers = std::min<size_t>(std::max(threads, 1), index->layers.size());
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < problems.size(); ++i) {
    if (!problems[i].empty()) {
      report.differences.push_back({rank, index->layers[i].layer, index->layers[i].resident.file, problems[i]});
    }
  }
  return report;
}

VerifyReport Release::VerifyListedFiles() const {
  VerifyReport report;
  for (const CompleteEntry& c : complete_) {
    // Layer files are checked below against their index (which COMPLETE agrees with).
    std::optional<uint32_t> rank;
    if (c.path != kManifestFile) {
      bool is_index = false;
      for (const RankIndex& index : indexes_) {
        if (c.path == RankIndexFile(index.rank)) {
          is_index = true;
          rank = index.rank;
        }
      }
      if (!is_index) continue;
    }
    auto sha = Sha256File(Path(c.path));
    if (!sha.ok() || *sha != c.sha256) {
      report.differences.push_back(
          {rank, std::nullopt, c.path,
           sha.ok() ? "sha256 differs" : std::string(sha.status().message())});
    }
  }
  return report;
}

}  // namespace nq::format
