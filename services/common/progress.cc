#include "services/common/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace nq {

std::string HumanQuantity(double value, std::string_view unit) {
  static constexpr const char* kPrefixes[] = {"", "k", "M", "G", "T"};
  int prefix = 0;
  while (std::fabs(value) >= 1000 && prefix < 4) {
    value /= 1000;
    ++prefix;
  }
  // A symbol takes its prefix directly ("1.21 GB"); a word is kept apart ("1.21 G weights").
  const std::string_view gap = unit.size() > 1 && prefix > 0 ? " " : "";
  return absl::StrFormat(prefix == 0 ? "%.0f %s%s%s" : "%.2f %s%s%s", value, kPrefixes[prefix], gap, unit);
}

std::string HumanDuration(absl::Duration d) {
  const int64_t seconds = absl::ToInt64Seconds(d < absl::ZeroDuration() ? absl::ZeroDuration() : d);
  if (seconds < 60) return absl::StrCat(seconds, "s");
  if (seconds < 3600) return absl::StrFormat("%dm%02ds", seconds / 60, seconds % 60);
  return absl::StrFormat("%dh%02dm", seconds / 3600, (seconds % 3600) / 60);
}

std::string FormatProgress(const ProgressState& state, std::string_view unit, std::string_view work_unit,
                           absl::Duration elapsed) {
  const double percent = state.total > 0 ? 100.0 * static_cast<double>(state.done) / static_cast<double>(state.total) : 100.0;
  std::string line = absl::StrFormat("%d/%d %s (%.1f%%)", state.done, state.total, unit, percent);
  if (!state.stage.empty()) absl::StrAppend(&line, ", ", state.stage);
  const double seconds = absl::ToDoubleSeconds(elapsed);
  if (state.work > 0) {
    absl::StrAppend(&line, "; ", HumanQuantity(state.work, work_unit));
    if (seconds > 0) absl::StrAppend(&line, " at ", HumanQuantity(state.work / seconds, work_unit), "/s");
  }
  absl::StrAppend(&line, "; ", HumanDuration(elapsed), " elapsed");
  // Only units that took work predict the rest (skipped ones took none).
  const int64_t worked = state.done - state.skipped;
  if (state.done >= state.total) {
    absl::StrAppend(&line, ", done");
  } else if (worked > 0 && seconds > 0) {
    const double left = seconds * static_cast<double>(state.total - state.done) / static_cast<double>(worked);
    absl::StrAppend(&line, ", ~", HumanDuration(absl::Seconds(left)), " left");
  }
  return line;
}

bool StderrIsTerminal() { return isatty(STDERR_FILENO) == 1; }

ProgressReporter::ProgressReporter(ProgressOptions options) : options_(std::move(options)) {
  if (!options_.clock) options_.clock = [] { return absl::Now(); };
  if (!options_.write) {
    options_.write = [](std::string_view text) {
      std::fwrite(text.data(), 1, text.size(), stderr);
      std::fflush(stderr);
    };
  }
  start_ = options_.clock();
}

void ProgressReporter::Update(const ProgressState& state) {
  state_ = state;
  finished_ = false;
  const absl::Time now = options_.clock();
  const bool last = state.done >= state.total;
  const absl::Duration interval = options_.terminal ? options_.redraw_interval : options_.line_interval;
  if (last || !last_print_.has_value() || now - *last_print_ >= interval) Print(last);
}

void ProgressReporter::Finish() {
  if (last_print_.has_value() && !finished_) Print(/*final_line=*/true);
}

void ProgressReporter::Print(bool final_line) {
  const absl::Time now = options_.clock();
  last_print_ = now;
  const std::string body = FormatProgress(state_, options_.unit, options_.work_unit, now - start_);
  if (options_.terminal) {
    // \r and clear-to-end-of-line redraw in place; the final line keeps its newline.
    options_.write(absl::StrCat("\r\033[K", "nq ", options_.task, ": ", body, final_line ? "\n" : ""));
  } else {
    options_.write(absl::StrCat("nq ", options_.task, ": ", body, "\n"));
  }
  finished_ = final_line;
}

}  // namespace nq
