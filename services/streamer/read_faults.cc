#include "services/streamer/read_faults.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace nq::streamer {

absl::StatusOr<ReadFaults> ParseReadFaults(const std::string& text) {
  ReadFaults faults;
  if (text.empty()) return faults;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    double p = 0;
    if (kv.first == "seed") {
      if (!absl::SimpleAtoi(kv.second, &faults.seed)) {
        return absl::InvalidArgumentError(absl::StrCat("read faults: '", part, "': seed wants an integer"));
      }
      continue;
    }
    if (!absl::SimpleAtod(kv.second, &p) || !(p >= 0 && p <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("read faults: '", part, "': want eio=P, short=P (P in [0, 1]) or seed=N"));
    }
    if (kv.first == "eio") {
      faults.eio = p;
    } else if (kv.first == "short") {
      faults.short_read = p;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("read faults: unknown fault '", kv.first, "' (want eio, short or seed)"));
    }
  }
  return faults;
}

ReadFault ReadFaultInjector::Next() {
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  if (u < faults_.eio) return ReadFault::kIoError;
  if (u < faults_.eio + faults_.short_read) return ReadFault::kShortRead;
  return ReadFault::kNone;
}

}  // namespace nq::streamer
