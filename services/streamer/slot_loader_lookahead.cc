// SlotLoader's gate-lookahead hints (issue #21; slot_loader.h says what a hint may and may not do).
// Kept apart from slot_loader.cc: a hint only adds Wants at the front of the queue, and every
// slot it touches goes through Pump/StartLoad/Finish like any other load.
#include <algorithm>
#include <chrono>
#include <optional>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/streamer/slot_loader.h"

namespace nq::streamer {
namespace {

// A worker sending malformed hints does so for every token: one log line per interval.
constexpr std::chrono::seconds kHintLogInterval(10);

}  // namespace

absl::Status SlotLoader::CheckHint(const nq::v1::LookaheadHint& hint) const {
  const SlotGeometry& g = worker_->geometry;
  if (!g.LayerIndex(hint.layer()).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("lookahead hint for layer ", hint.layer(),
                                                   ", which has no slots in the worker's arena"));
  }
  if (hint.experts_size() == 0 || static_cast<uint32_t>(hint.experts_size()) > g.experts_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat("lookahead hint for layer ", hint.layer(), " names ",
                                                   hint.experts_size(), " experts; the layer has ",
                                                   g.experts_per_layer));
  }
  if (hint.weights_size() != 0 && hint.weights_size() != hint.experts_size()) {
    return absl::InvalidArgumentError(absl::StrCat("lookahead hint for layer ", hint.layer(), ": ",
                                                   hint.weights_size(), " weights for ", hint.experts_size(),
                                                   " experts"));
  }
  std::set<uint32_t> seen;
  for (uint32_t e : hint.experts()) {
    if (e >= g.experts_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat("lookahead hint for layer ", hint.layer(), " names expert ", e,
                                                     "; the layer has ", g.experts_per_layer));
    }
    if (!seen.insert(e).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("lookahead hint for layer ", hint.layer(), " names expert ", e, " twice"));
    }
  }
  if (hint.sequence_id() < latest_sequence_) {
    return absl::FailedPreconditionError(absl::StrCat("lookahead hint of sequence ", hint.sequence_id(),
                                                      ", older than the session's latest sequence ",
                                                      latest_sequence_));
  }
  return absl::OkStatus();
}

uint32_t SlotLoader::HintVictim(size_t layer_index, const std::set<uint32_t>& keep) const {
  const SlotGeometry& g = worker_->geometry;
  std::set<uint32_t> taken;  // victims of loads already queued for this layer
  for (const Want& want : queue_) {
    if (want.victim != PlannedLoad::kNoVictim && g.LayerIndex(want.layer).value_or(SIZE_MAX) == layer_index) {
      taken.insert(want.victim);
    }
  }
  const auto desired = plan_desired_.find(layer_index);
  uint32_t fallback = PlannedLoad::kNoVictim;
  for (uint32_t s = g.fixed_slots_per_layer; s < g.slots_per_layer; ++s) {
    if (allocator_.state(layer_index, s) != SlotState::kReady) continue;
    const uint32_t expert = static_cast<uint32_t>(allocator_.expert(layer_index, s));
    if (keep.count(expert) != 0 || taken.count(expert) != 0) continue;
    if (desired == plan_desired_.end() || desired->second.count(expert) == 0) return expert;
    if (fallback == PlannedLoad::kNoVictim) fallback = expert;
  }
  return fallback;
}

void SlotLoader::HandleHint(const nq::v1::LookaheadHint& hint) {
  if (absl::Status s = CheckHint(hint); !s.ok()) {
    metrics_->hints_refused.Increment();
    {
      absl::MutexLock lock(&mu_);
      ++stats_.hints_refused;
    }
    static LogRateLimiter refused_log(kHintLogInterval);
    if (long n = refused_log.Allow()) {
      spdlog::warn("worker {}: lookahead hint refused: {} ({} since last report)", worker_->worker_id, s.ToString(),
                   n);
    }
    return;
  }
  metrics_->hints_accepted.Increment();
  latest_sequence_ = hint.sequence_id();
  // A new token: what earlier tokens' hints named may be evicted again.
  if (const std::pair<uint64_t, uint64_t> token{hint.sequence_id(), hint.token()}; token != hint_token_) {
    hint_token_ = token;
    token_hinted_.clear();
  }
  const size_t li = *worker_->geometry.LayerIndex(hint.layer());  // CheckHint
  std::set<uint32_t>& keep = token_hinted_[li];
  keep.insert(hint.experts().begin(), hint.experts().end());
  // The layer keeps at most F floating experts once its loads land, as the predictor's plans do:
  // past F a hinted load names a victim, which leaves when the load lands (lazy eviction through
  // the staging slot) or, with no FREE slot, is unmapped first. So the staging slot stays free
  // for the next replacement, and the predictor's view of residency stays whole (Refresh).
  size_t occupied = allocator_.FloatingExperts(li).size();
  for (const Want& want : queue_) {
    if (want.layer == hint.layer() && want.victim == PlannedLoad::kNoVictim && !want.fixed) ++occupied;
  }
  std::vector<Want> loads;
  uint64_t unplaced = 0;
  const auto now = Clock::now();
  for (uint32_t expert : hint.experts()) {
    // Resident, loading, or known bad: nothing to do (a hint for a resident layer costs nothing).
    if (allocator_.SlotOf(li, expert).has_value() || failed_.count({hint.layer(), expert}) != 0) continue;
    // Already queued (by a refresh or an earlier hint): never loaded twice. A refresh's load is
    // taken over (it keeps its decision time) with a victim chosen as a hint's is, so that it
    // too spares what this token uses.
    Want want{
        .layer = hint.layer(), .expert = expert, .fixed = false, .decided = now, .hinted = true, .hinted_at = now};
    auto queued = std::find_if(queue_.begin(), queue_.end(),
                               [&](const Want& w) { return w.layer == hint.layer() && w.expert == expert; });
    std::optional<Want> planned;
    if (queued != queue_.end()) {
      if (queued->fixed || queued->hinted) continue;
      planned = *queued;
      want.decided = queued->decided;
      if (queued->victim == PlannedLoad::kNoVictim && occupied > 0) --occupied;  // counted above
      queue_.erase(queued);
    }
    if (occupied < allocator_.floating_slots()) {
      ++occupied;  // room below F: no victim
    } else {
      want.victim = HintVictim(li, keep);
      if (want.victim == PlannedLoad::kNoVictim) {
        ++unplaced;
        if (planned.has_value()) queue_.push_back(*planned);  // the refresh's load stays as it was
        continue;
      }
    }
    loads.push_back(want);
    // Each victim is named once: the next expert's search skips it.
    queue_.push_front(want);
  }
  // The loads above went to the front in reverse; put them best first (the hint's order).
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                              [&](const Want& w) {
                                return w.hinted && w.layer == hint.layer() &&
                                       std::any_of(loads.begin(), loads.end(),
                                                   [&](const Want& l) { return l.expert == w.expert; });
                              }),
               queue_.end());
  queue_.insert(queue_.begin(), loads.begin(), loads.end());
  metrics_->hint_loads_queued.Increment(static_cast<double>(loads.size()));
  metrics_->hint_loads_unplaced.Increment(static_cast<double>(unplaced));
  {
    absl::MutexLock lock(&mu_);
    ++stats_.hints_accepted;
    stats_.hint_loads_queued += loads.size();
    stats_.hint_loads_unplaced += unplaced;
  }
}

}  // namespace nq::streamer
