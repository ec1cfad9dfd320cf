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
    if (kv.first == "rank") {
      uint32_t rank = 0;
      if (!absl::SimpleAtoi(kv.second, &rank)) {
        return absl::InvalidArgumentError(absl::StrCat("read faults: '", part, "': rank wants an integer"));
      }
      faults.rank = rank;
      continue;
    }
    absl::string_view probability = kv.second;
    if (kv.first == "slow") {
      const std::pair<absl::string_view, absl::string_view> pm = absl::StrSplit(kv.second, absl::MaxSplits(':', 1));
      probability = pm.first;
      if (!absl::SimpleAtoi(pm.second, &faults.slow_ms) || faults.slow_ms == 0 || faults.slow_ms > kMaxSlowReadMs) {
        return absl::InvalidArgumentError(absl::StrCat("read faults: '", part, "': want slow=P:MS with MS in [1, ",
                                                       kMaxSlowReadMs, "] milliseconds"));
      }
    }
    if (!absl::SimpleAtod(probability, &p) || !(p >= 0 && p <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat("read faults: '", part,
                                                     "': want eio=P, short=P, slow=P:MS (P in [0, 1]) seed=N or rank=R"));
    }
    if (kv.first == "eio") {
      faults.eio = p;
    } else if (kv.first == "short") {
      faults.short_read = p;
    } else if (kv.first == "slow") {
      faults.slow = p;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("read faults: unknown fault '", kv.first, "' (want eio, short, slow, seed or rank)"));
    }
  }
  // One draw per read picks at most one fault, so the probabilities share [0, 1].
  if (faults.eio + faults.short_read + faults.slow > 1) {
    return absl::InvalidArgumentError(absl::StrCat("read faults: '", text, "': the probabilities add up to more than 1"));
  }
  return faults;
}

ReadFault ReadFaultInjector::Next() {
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  if (u < faults_.eio) return ReadFault::kIoError;
  if (u < faults_.eio + faults_.short_read) return ReadFault::kShortRead;
  if (u < faults_.eio + faults_.short_read + faults_.slow) return ReadFault::kSlow;
  return ReadFault::kNone;
}

}  // namespace nq::streamer
