// A slot loader's side of its worker's slot mailbox (services/common/slot_mailbox.h, DESIGN.md
// section 4): posts the READYs and UNMAPs of each update there instead of sending them, then
// tells, poll by poll, which posts the worker has applied.
//
// A post is applied once the mailbox's published seq for its (layer, expert) reached the post's
// seq. A later post of the same expert counts for the earlier ones: the worker's table holds one
// slot per expert, so once it took the later row, the earlier row's slot is no longer mapped.
//
// An unmapped slot may be reused only once the worker applied the unmap. That replaces the
// UnmapAck of the update protocol, so Poll hands back, for each generation whose every unmap is
// applied, the UnmapAck the worker would have sent: the loader's allocator and metrics keep one
// path (SlotLoader::HandleAck).
//
// The worker publishes without signalling the streamer, so the loader polls: while anything is
// pending its thread sleeps at most kMailboxPollInterval. Not thread-safe: the loader thread owns
// it. A stopped loader's pending posts are dropped with it: the worker applies every posted row
// before its next hello, whose table the next loader adopts.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "nq/v1/streamer.pb.h"
#include "services/common/slot_mailbox.h"
#include "services/streamer/loader_metrics.h"
#include "services/streamer/slot_allocator.h"

namespace nq::streamer {

// How long a change the worker applied may wait for the loader to see it: a slot is reused that
// much later at worst, small against a decode step (tens of ms), and a poll is one load per
// pending post.
inline constexpr absl::Duration kMailboxPollInterval = absl::Milliseconds(1);

class MailboxPoster {
 public:
  // `mailbox` is the worker's, of `allocator`'s geometry; `allocator` names the expert an
  // UNMAP's slot holds. All three outlive the poster.
  MailboxPoster(SlotMailbox* mailbox, const SlotAllocator* allocator, LoaderMetrics* metrics);

  // Posts `update`'s changes as update `generation`: every UNMAP first (their slots UNMAPPING in
  // the allocator), then every READY (their bytes complete in the slot), so an expert unmapped
  // from one slot and READY in another in the same update ends mapped. Changes of a layer outside
  // the geometry are skipped (the loader never makes them).
  void Post(uint64_t generation, const nq::v1::SlotTableUpdate& update);
  // Observes the lag of every post now applied, and returns the acknowledgement of each
  // generation whose every unmap is, oldest first (each returned once).
  std::vector<nq::v1::UnmapAck> Poll();
  // Whether a post waits to be seen applied (the loader then polls every kMailboxPollInterval).
  bool pending() const { return !posts_.empty() || !unmaps_.empty(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Posted {
    size_t layer_index = 0;
    uint32_t expert = 0;
    uint32_t seq = 0;
  };
  struct PostedUnmap {
    Posted post;
    nq::v1::SlotRef slot;  // model layer id and slot, as the acknowledgement names it
  };
  // Null when the mailbox refused the post (logged).
  std::optional<Posted> PostOne(size_t layer_index, uint32_t expert, int32_t slot);
  bool Applied(const Posted& post) const;

  SlotMailbox* const mailbox_;
  const SlotAllocator* const allocator_;
  LoaderMetrics* const metrics_;
  // Every post not yet seen applied, with its time (nq_streamer_mailbox_lag_seconds).
  std::vector<std::pair<Posted, Clock::time_point>> posts_;
  // By generation: its unmaps, until all are applied.
  std::map<uint64_t, std::vector<PostedUnmap>> unmaps_;
};

}  // namespace nq::streamer
