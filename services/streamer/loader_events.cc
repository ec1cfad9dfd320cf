#include "services/streamer/loader_events.h"

#include <algorithm>
#include <utility>

namespace nq::streamer {

LoaderEvents::LoaderEvents(size_t max_reports, metrics::Counter* dropped, size_t max_hints,
                           metrics::Counter* dropped_hints)
    : max_reports_(std::max<size_t>(max_reports, 1)),
      dropped_(dropped),
      max_hints_(max_hints),
      dropped_hints_(dropped_hints) {}

bool LoaderEvents::PushHint(nq::v1::LookaheadHint hint) {
  if (queued_hints_ >= max_hints_) {
    ++dropped_hints_count_;
    if (dropped_hints_ != nullptr) dropped_hints_->Increment();
    return false;
  }
  events_.emplace_back(std::move(hint));
  ++queued_hints_;
  return true;
}

bool LoaderEvents::PushReport(nq::v1::RoutingReport report) {
  if (queued_reports_ >= max_reports_) {
    ++dropped_reports_;
    if (dropped_ != nullptr) dropped_->Increment();
    return false;
  }
  events_.emplace_back(std::move(report));
  ++queued_reports_;
  return true;
}

void LoaderEvents::PushAck(nq::v1::UnmapAck ack) { events_.emplace_back(std::move(ack)); }

void LoaderEvents::PushRankAck(uint32_t rank, nq::v1::UnmapAck ack) {
  events_.emplace_back(RankAck{.rank = rank, .ack = std::move(ack)});
}

void LoaderEvents::PushPeerResult(uint32_t rank, nq::v1::LoadResult result) {
  events_.emplace_back(PeerResult{.rank = rank, .result = std::move(result)});
}

std::deque<LoaderEvents::Event> LoaderEvents::TakeAll() {
  std::deque<Event> taken;
  taken.swap(events_);
  queued_reports_ = 0;
  queued_hints_ = 0;
  return taken;
}

}  // namespace nq::streamer
