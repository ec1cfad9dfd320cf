// nq assemble --src REL --into DIR [--layers a-b] [--dry-run] (DESIGN.md section 5):
// installs layers of a complete release into a serving directory, one (layer, rank) at a
// time, in the order that keeps every index entry in DIR true at every instant:
//
//   1. drop the layer from rank{r}.json (rewritten atomically),
//   2. write the records at their offset in rank{r}/L{L}.bin and fsync,
//   3. read them back and hash them against the source index (DATA_LOSS if they differ),
//   4. replace res/rank{r}/L{L}.safetensors by tmp + rename,
//   5. write rank{r}.json with the layer's entry, atomically.
//
// COMPLETE is removed before the first change and written after the last, only when DIR
// then holds every layer of the manifest on every rank. A (layer, rank) whose entry in DIR
// already equals the source's and whose files hash right is skipped, so assembling twice is
// a no-op and rerunning after an interruption finishes the job with the same bytes an
// uninterrupted run leaves.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/common/progress.h"

namespace nq::format {

// Inclusive range of model layer ids.
struct LayerRange {
  uint32_t first = 0;
  uint32_t last = UINT32_MAX;
  bool Contains(uint32_t layer) const { return layer >= first && layer <= last; }
};
// "a-b" or "a"; INVALID_ARGUMENT otherwise or when a > b.
absl::StatusOr<LayerRange> ParseLayerRange(const std::string& text);

enum class AssembleStep {
  kRemoveComplete,
  kWriteManifest,
  kDropFromIndex,  // per (layer, rank), steps 1-5 above
  kWriteRecords,
  kVerifyRecords,
  kReplaceResident,
  kWriteIndex,
  kWriteComplete,
};
const char* AssembleStepName(AssembleStep step);

struct StepEvent {
  AssembleStep step;
  std::optional<uint32_t> rank;  // set for the per-(layer, rank) steps
  std::optional<uint32_t> layer;
};

// Called after each step completes; an error stops Assemble, which returns it. Tests use
// it as a failpoint to simulate an interruption after any step.
using StepHook = std::function<absl::Status(const StepEvent&)>;

struct AssembleOptions {
  std::optional<LayerRange> layers;  // all of the source's layers when absent
  bool dry_run = false;              // plan only; touch nothing
  StepHook after_step;
  // Hears after each (layer, rank) installed: installs and already-installed ones of the plan
  // (the latter as skipped), bytes copied as the work. May be empty.
  std::function<void(const ProgressState&)> progress;
};

struct AssemblePlan {
  std::vector<std::pair<uint32_t, uint32_t>> installs;  // (layer, rank), in install order
  std::vector<std::pair<uint32_t, uint32_t>> skipped;   // already installed
  bool write_manifest = false;
  bool write_complete = false;  // DIR ends complete and COMPLETE changes
  bool complete_after = false;  // DIR holds every layer on every rank afterwards

  bool no_op() const { return installs.empty() && !write_manifest && !write_complete; }
  // Human-readable, one line per action, for nq assemble's output.
  std::string ToString() const;
};

// Installs the selected layers of release `src` (which must be complete) into `into`
// (created if missing). FAILED_PRECONDITION when `into` holds a release of another model,
// codec or TP size, or the range selects no layer; DATA_LOSS when bytes read back differ
// from the source's index. Returns the plan it carried out (or, with dry_run, would).
absl::StatusOr<AssemblePlan> Assemble(const std::string& src, const std::string& into,
                                      const AssembleOptions& options = {});

}  // namespace nq::format
