#include "services/format/assemble.h"

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/format/manifest.h"
#include "services/format/rank_index.h"
#include "services/format/release_reader.h"
#include "services/format/release_writer.h"

namespace nq::format {
namespace {

namespace fs = std::filesystem;

std::string Join(const std::string& dir, const std::string& relative) {
  return (fs::path(dir) / relative).string();
}

// Two releases may share a directory only when they encode the same model the same way;
// per-layer data (rotation, fixed set, ranking) may differ and follows the installed layer.
absl::Status CheckSameIdentity(const Manifest& into, const Manifest& src, const std::string& dir) {
  const std::pair<bool, const char*> fields[] = {
      {into.source_model != src.source_model, "source model"},
      {into.config_hash != src.config_hash, "config hash"},
      {into.tp_size != src.tp_size, "tp_size"},
      {into.experts_per_layer != src.experts_per_layer, "experts per layer"},
      {into.codec != src.codec || into.codec_params != src.codec_params, "codec"},
      {into.LayerIds() != src.LayerIds(), "layer ids"},
  };
  std::vector<std::string> differing;
  for (const auto& [differs, name] : fields) {
    if (differs) differing.push_back(name);
  }
  if (differing.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(dir, " holds a release whose ", absl::StrJoin(differing, ", "),
                   " differs from the source's; assemble into an empty directory"));
}

class Assembler {
 public:
  Assembler(Release src, std::string into, const AssembleOptions& options)
      : src_(std::move(src)), into_(std::move(into)), options_(options) {}

  // Reads the destination and decides what to do; touches nothing.
  absl::StatusOr<AssemblePlan> Plan();
  // Carries out a plan from Plan().
  absl::Status Execute(const AssemblePlan& plan);

 private:
  absl::Status After(AssembleStep step, std::optional<uint32_t> rank = std::nullopt,
                     std::optional<uint32_t> layer = std::nullopt) {
    if (!options_.after_step) return absl::OkStatus();
    return options_.after_step(StepEvent{step, rank, layer});
  }
  absl::Status InstallLayer(uint32_t rank, const LayerEntry& entry);
  // True when no entry of `index` other than `layer`'s uses `file`.
  static bool FileExclusive(const RankIndex& index, const std::string& file, uint32_t layer);

  Release src_;
  std::string into_;
  const AssembleOptions& options_;
  std::vector<RankIndex> indexes_;  // the destination's, as on disk (then as installed)
  std::string manifest_text_;       // the destination's manifest.json to be
  std::string complete_text_;       // its COMPLETE to be, when it ends complete
};

bool Assembler::FileExclusive(const RankIndex& index, const std::string& file, uint32_t layer) {
  for (const LayerEntry& e : index.layers) {
    if (e.layer != layer && e.records.file == file) return false;
  }
  return true;
}

absl::Status Assembler::InstallLayer(uint32_t rank, const LayerEntry& entry) {
  RankIndex& index = indexes_[rank];
  const std::string index_path = Join(into_, RankIndexFile(rank));
  const std::string where = absl::StrCat("rank ", rank, " layer ", entry.layer);

  // 1. Drop the layer: from here until step 5 no reader trusts its bytes.
  if (index.Remove(entry.layer)) {
    RETURN_IF_ERROR(WriteFileAtomic(index_path, SerializeRankIndex(index)));
  }
  RETURN_IF_ERROR(After(AssembleStep::kDropFromIndex, rank, entry.layer));

  // 2. Records at their offset; a longer file left by an earlier layout is cut to size.
  const std::string records_path = Join(into_, entry.records.file);
  RETURN_IF_ERROR(MakeDirs(fs::path(records_path).parent_path().string()));
  {
    ASSIGN_OR_RETURN(Fd fd, OpenForWrite(records_path));
    ASSIGN_OR_RETURN(std::string copied_sha,
                     CopyRange(Join(src_.dir(), entry.records.file), entry.records.offset,
                               entry.records.bytes, fd.get(), entry.records.offset, records_path));
    if (copied_sha != entry.records.sha256) {
      return absl::DataLossError(absl::StrCat(where, ": the source's ", entry.records.file,
                                              " does not hash to its index (run nq verify)"));
    }
    const uint64_t end = entry.records.offset + entry.records.bytes;
    ASSIGN_OR_RETURN(uint64_t size, FileSize(records_path));
    if (size > end && FileExclusive(index, entry.records.file, entry.layer)) {
      RETURN_IF_ERROR(Truncate(fd.get(), end, records_path));
    }
    RETURN_IF_ERROR(FSync(fd.get(), records_path));
  }
  RETURN_IF_ERROR(After(AssembleStep::kWriteRecords, rank, entry.layer));

  // 3. Read back and hash what landed.
  ASSIGN_OR_RETURN(std::string read_back,
                   Sha256FileRange(records_path, entry.records.offset, entry.records.bytes));
  if (read_back != entry.records.sha256) {
    return absl::DataLossError(absl::StrCat(where, ": records read back from ", records_path,
                                            " hash to ", read_back, ", expected ",
                                            entry.records.sha256));
  }
  RETURN_IF_ERROR(After(AssembleStep::kVerifyRecords, rank, entry.layer));

  // 4. The resident file, replaced atomically.
  const std::string resident_path = Join(into_, entry.resident.file);
  RETURN_IF_ERROR(MakeDirs(fs::path(resident_path).parent_path().string()));
  ASSIGN_OR_RETURN(std::string resident_sha,
                   CopyFileAtomic(Join(src_.dir(), entry.resident.file), resident_path));
  if (resident_sha != entry.resident.sha256) {
    return absl::DataLossError(absl::StrCat(where, ": the source's ", entry.resident.file,
                                            " does not hash to its index (run nq verify)"));
  }
  RETURN_IF_ERROR(After(AssembleStep::kReplaceResident, rank, entry.layer));

  // 5. The index with the layer back in.
  index.Upsert(entry);
  RETURN_IF_ERROR(index.Validate());
  RETURN_IF_ERROR(WriteFileAtomic(index_path, SerializeRankIndex(index)));
  return After(AssembleStep::kWriteIndex, rank, entry.layer);
}

absl::StatusOr<AssemblePlan> Assembler::Plan() {
  const Manifest& src_manifest = src_.manifest();
  std::vector<uint32_t> selected;
  for (uint32_t layer : src_manifest.LayerIds()) {
    if (!options_.layers.has_value() || options_.layers->Contains(layer)) selected.push_back(layer);
  }
  if (selected.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the layer range selects none of ", src_.dir(), "'s layers"));
  }

  // The destination's manifest: its own with the selected layers' entries from the source.
  Manifest manifest = src_manifest;
  std::string manifest_on_disk;
  if (FileExists(Join(into_, kManifestFile))) {
    ASSIGN_OR_RETURN(manifest_on_disk, ReadFileToString(Join(into_, kManifestFile)));
    auto existing = ParseManifest(manifest_on_disk);
    if (!existing.ok()) return Annotate(existing.status(), into_);
    RETURN_IF_ERROR(CheckSameIdentity(*existing, src_manifest, into_));
    manifest = *std::move(existing);
    for (ManifestLayer& l : manifest.layers) {
      if (std::find(selected.begin(), selected.end(), l.layer) != selected.end()) {
        l = *src_manifest.FindLayer(l.layer);
      }
    }
  }
  manifest_text_ = SerializeManifest(manifest);

  std::vector<std::string> index_on_disk(manifest.tp_size);
  for (uint32_t r = 0; r < manifest.tp_size; ++r) {
    const std::string path = Join(into_, RankIndexFile(r));
    if (FileExists(path)) {
      ASSIGN_OR_RETURN(index_on_disk[r], ReadFileToString(path));
      auto index = ParseRankIndex(index_on_disk[r], RankIndexFile(r));
      if (!index.ok()) return Annotate(index.status(), into_);
      indexes_.push_back(*std::move(index));
    } else {
      indexes_.push_back(EmptyRankIndex(manifest, r));
    }
  }

  AssemblePlan plan;
  plan.write_manifest = manifest_on_disk != manifest_text_;
  std::vector<RankIndex> final_indexes = indexes_;
  std::vector<bool> rank_changes(manifest.tp_size, false);
  for (uint32_t layer : selected) {
    for (uint32_t r = 0; r < manifest.tp_size; ++r) {
      ASSIGN_OR_RETURN(const LayerEntry* want, src_.Layer(r, layer));
      const LayerEntry* have = indexes_[r].FindLayer(layer);
      bool installed = false;
      if (have != nullptr && *have == *want) {
        ASSIGN_OR_RETURN(installed, LayerFilesMatch(into_, *have));
      }
      (installed ? plan.skipped : plan.installs).emplace_back(layer, r);
      if (!installed) {
        final_indexes[r].Upsert(*want);
        rank_changes[r] = true;
      }
    }
  }

  plan.complete_after = true;
  for (const RankIndex& index : final_indexes) {
    for (uint32_t layer : manifest.LayerIds()) {
      if (index.FindLayer(layer) == nullptr) plan.complete_after = false;
    }
  }
  if (plan.complete_after) {
    // What COMPLETE will say: the serializations are deterministic, so the hashes of the
    // files still to be written are known now; an index left alone keeps its bytes.
    std::vector<CompleteEntry> entries = {{kManifestFile, Sha256Hex(manifest_text_)}};
    for (const RankIndex& index : final_indexes) {
      entries.push_back({RankIndexFile(index.rank),
                         Sha256Hex(rank_changes[index.rank] ? SerializeRankIndex(index)
                                                            : index_on_disk[index.rank])});
      for (const LayerEntry& e : index.layers) {
        entries.push_back({e.records.file, e.records.sha256});
        entries.push_back({e.resident.file, e.resident.sha256});
      }
    }
    complete_text_ = SerializeComplete(std::move(entries));
    std::string on_disk;
    if (FileExists(Join(into_, kCompleteFile))) {
      ASSIGN_OR_RETURN(on_disk, ReadFileToString(Join(into_, kCompleteFile)));
    }
    plan.write_complete = on_disk != complete_text_;
  }
  return plan;
}

absl::Status Assembler::Execute(const AssemblePlan& plan) {
  RETURN_IF_ERROR(MakeDirs(into_));
  RETURN_IF_ERROR(RemoveFile(Join(into_, kCompleteFile)));
  RETURN_IF_ERROR(After(AssembleStep::kRemoveComplete));
  if (plan.write_manifest) {
    RETURN_IF_ERROR(WriteFileAtomic(Join(into_, kManifestFile), manifest_text_));
    RETURN_IF_ERROR(After(AssembleStep::kWriteManifest));
  }
  ProgressState progress{.done = static_cast<int64_t>(plan.skipped.size()),
                         .total = static_cast<int64_t>(plan.installs.size() + plan.skipped.size()),
                         .skipped = static_cast<int64_t>(plan.skipped.size())};
  for (const auto& [layer, r] : plan.installs) {
    ASSIGN_OR_RETURN(const LayerEntry* entry, src_.Layer(r, layer));
    RETURN_IF_ERROR(InstallLayer(r, *entry));
    ++progress.done;
    progress.work += static_cast<double>(entry->records.bytes + entry->resident.bytes);
    progress.stage = absl::StrCat("layer ", layer, " rank ", r);
    if (options_.progress) options_.progress(progress);
  }
  if (!plan.complete_after) return absl::OkStatus();
  RETURN_IF_ERROR(WriteFileAtomic(Join(into_, kCompleteFile), complete_text_));
  return After(AssembleStep::kWriteComplete);
}

}  // namespace

absl::StatusOr<LayerRange> ParseLayerRange(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, '-');
  LayerRange range;
  bool ok = (parts.size() == 1 || parts.size() == 2) && absl::SimpleAtoi(parts[0], &range.first);
  range.last = range.first;
  if (ok && parts.size() == 2) ok = absl::SimpleAtoi(parts[1], &range.last);
  if (!ok || range.first > range.last) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer range '", text, "' is not 'a-b' (a <= b) or 'a'"));
  }
  return range;
}

const char* AssembleStepName(AssembleStep step) {
  switch (step) {
    case AssembleStep::kRemoveComplete:
      return "remove COMPLETE";
    case AssembleStep::kWriteManifest:
      return "write manifest";
    case AssembleStep::kDropFromIndex:
      return "drop from index";
    case AssembleStep::kWriteRecords:
      return "write records";
    case AssembleStep::kVerifyRecords:
      return "read back and hash records";
    case AssembleStep::kReplaceResident:
      return "replace resident file";
    case AssembleStep::kWriteIndex:
      return "write index";
    case AssembleStep::kWriteComplete:
      return "write COMPLETE";
  }
  return "unknown step";
}

std::string AssemblePlan::ToString() const {
  std::string text;
  if (write_manifest) absl::StrAppend(&text, "write manifest.json\n");
  for (const auto& [layer, rank] : installs) {
    absl::StrAppend(&text, "install layer ", layer, " rank ", rank, "\n");
  }
  for (const auto& [layer, rank] : skipped) {
    absl::StrAppend(&text, "skip layer ", layer, " rank ", rank, " (already installed)\n");
  }
  if (write_complete) absl::StrAppend(&text, "write COMPLETE\n");
  if (!complete_after)
    absl::StrAppend(&text, "the directory will still lack layers: no COMPLETE\n");
  return text;
}

absl::StatusOr<AssemblePlan> Assemble(const std::string& src, const std::string& into,
                                      const AssembleOptions& options) {
  ASSIGN_OR_RETURN(Release release, Release::Open(src));
  Assembler assembler(std::move(release), into, options);
  ASSIGN_OR_RETURN(AssemblePlan plan, assembler.Plan());
  if (!options.dry_run && !plan.no_op()) RETURN_IF_ERROR(assembler.Execute(plan));
  return plan;
}

}  // namespace nq::format
