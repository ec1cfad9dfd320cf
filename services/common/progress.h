// Progress of the hours-long offline jobs (issue #16: nq calibrate, encode, verify, assemble).
// On a terminal: one line redrawn in place (at most every `redraw_interval`). Otherwise (a log
// file, a CI job, `kubectl logs`): a plain line when the job starts, then at most every
// `line_interval`, and a last one when it ends. Each line says what is done of what, where the
// job is, how much work it did at what rate, and how long it has left:
//
//   nq encode: 3072/19968 experts (15.4%), layer 12 rank 0; 1.21 G weights at 3.10 M weights/s;
//   6m31s elapsed, ~35m50s left
//
// Units done without work (a resumed encode's layers already on disk, an assemble's layers
// already installed) are `skipped`: they count toward "done" but not toward the rate, so the
// estimate of what is left stays honest after a resume. Not thread-safe (the job's own thread
// reports).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace nq {

struct ProgressOptions {
  std::string task;                 // "encode": lines start "nq encode: "
  std::string unit;                 // what done/total count: "experts", "files"
  std::string work_unit = "B";      // what `work` counts: "B" (bytes) or e.g. "weights"
  bool terminal = false;            // redraw one line in place instead of printing lines
  absl::Duration line_interval = absl::Seconds(30);
  absl::Duration redraw_interval = absl::Milliseconds(200);
  std::function<void(std::string_view)> write;  // where text goes; stderr when empty
  std::function<absl::Time()> clock;            // absl::Now when empty
};

// One report: `done` of `total` units, `skipped` of them without work, `work` done so far by
// this run (bytes or weights), and where the job is now (`stage`, may be empty).
struct ProgressState {
  int64_t done = 0;
  int64_t total = 0;
  int64_t skipped = 0;
  double work = 0;
  std::string stage;
};

// "3072/19968 experts (15.4%), layer 12 rank 0; 1.21 G weights at 3.10 M weights/s; 6m31s
// elapsed, ~35m50s left" (no "nq task: " prefix; ", done" instead of the estimate at the end).
// The work is left out while none was done, the estimate until a unit took work.
std::string FormatProgress(const ProgressState& state, std::string_view unit, std::string_view work_unit,
                           absl::Duration elapsed);

// (1234567, "B") -> "1.23 MB", (999, "B") -> "999 B", (2.5e9, "weights") -> "2.50 G weights";
// prefixes k, M, G, T.
std::string HumanQuantity(double value, std::string_view unit);
// 391 s -> "6m31s", 4000 s -> "1h06m", 12.4 s -> "12s".
std::string HumanDuration(absl::Duration d);

// Resolves ProgressOptions::terminal for stderr (isatty).
bool StderrIsTerminal();

class ProgressReporter {
 public:
  explicit ProgressReporter(ProgressOptions options);
  // Prints as the cadence allows; the first report and the one reaching total always print.
  void Update(const ProgressState& state);
  // Prints the last state as the final line, whatever the cadence (a job that ends early, or
  // stops on an error); nothing when nothing was reported.
  void Finish();

 private:
  void Print(bool final_line);

  ProgressOptions options_;
  absl::Time start_;
  std::optional<absl::Time> last_print_;
  ProgressState state_;
  bool finished_ = false;
};

}  // namespace nq
