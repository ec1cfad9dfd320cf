#include "services/streamer/mailbox_poster.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "kernels/slot_mailbox.h"

namespace nq::streamer {

MailboxPoster::MailboxPoster(SlotMailbox* mailbox, const SlotAllocator* allocator, LoaderMetrics* metrics)
    : mailbox_(mailbox), allocator_(allocator), metrics_(metrics) {}

std::optional<MailboxPoster::Posted> MailboxPoster::PostOne(size_t layer_index, uint32_t expert, int32_t slot) {
  absl::StatusOr<uint32_t> seq = mailbox_->Post(layer_index, expert, slot);
  if (!seq.ok()) {
    spdlog::critical("{}; not posted", seq.status().ToString());
    return std::nullopt;
  }
  const Posted post{.layer_index = layer_index, .expert = expert, .seq = *seq};
  posts_.emplace_back(post, Clock::now());
  return post;
}

void MailboxPoster::Post(uint64_t generation, const nq::v1::SlotTableUpdate& update) {
  const SlotGeometry& g = allocator_->geometry();
  for (const nq::v1::SlotChange& change : update.changes()) {
    if (change.kind() != nq::v1::SlotChange::KIND_UNMAP) continue;
    absl::StatusOr<size_t> li = g.LayerIndex(change.layer());
    if (!li.ok()) continue;
    // The slot is UNMAPPING and keeps its expert until the acknowledgement frees it.
    const int32_t expert = allocator_->expert(*li, change.slot());
    if (expert < 0 || static_cast<uint32_t>(expert) >= mailbox_->experts()) {
      spdlog::critical("slot mailbox {}: layer {} slot {} is unmapped but holds no expert; not posted",
                       mailbox_->name(), change.layer(), change.slot());
      continue;
    }
    std::optional<Posted> posted = PostOne(*li, static_cast<uint32_t>(expert), -1);
    if (!posted.has_value()) continue;
    PostedUnmap unmap;
    unmap.post = *posted;
    unmap.slot.set_layer(change.layer());
    unmap.slot.set_slot(change.slot());
    unmaps_[generation].push_back(std::move(unmap));
    metrics_->mailbox_posts_unmap.Increment();
  }
  for (const nq::v1::SlotChange& change : update.changes()) {
    if (change.kind() != nq::v1::SlotChange::KIND_READY) continue;
    absl::StatusOr<size_t> li = g.LayerIndex(change.layer());
    if (!li.ok()) continue;
    // A post outside the mailbox's rows would land in another region of it.
    if (change.expert() >= mailbox_->experts()) {
      spdlog::critical("slot mailbox {}: layer {} expert {} is outside its {} experts; not posted", mailbox_->name(),
                       change.layer(), change.expert(), mailbox_->experts());
      continue;
    }
    if (PostOne(*li, change.expert(), static_cast<int32_t>(change.slot())).has_value()) {
      metrics_->mailbox_posts_ready.Increment();
    }
  }
}

bool MailboxPoster::Applied(const Posted& post) const {
  const uint64_t published = mailbox_->Published(post.layer_index, post.expert);
  return kernels::MailboxSeqReached(kernels::MailboxEntrySeq(published), post.seq);
}

std::vector<nq::v1::UnmapAck> MailboxPoster::Poll() {
  const Clock::time_point now = Clock::now();
  std::erase_if(posts_, [&](const std::pair<Posted, Clock::time_point>& posted) {
    if (!Applied(posted.first)) return false;
    metrics_->mailbox_lag.Observe(std::chrono::duration<double>(now - posted.second).count());
    return true;
  });
  std::vector<nq::v1::UnmapAck> acks;
  for (auto it = unmaps_.begin(); it != unmaps_.end();) {
    const std::vector<PostedUnmap>& unmaps = it->second;
    if (!std::all_of(unmaps.begin(), unmaps.end(), [&](const PostedUnmap& u) { return Applied(u.post); })) {
      ++it;
      continue;
    }
    nq::v1::UnmapAck& ack = acks.emplace_back();
    ack.set_generation(it->first);
    for (const PostedUnmap& unmap : unmaps) *ack.add_slots() = unmap.slot;
    it = unmaps_.erase(it);
  }
  return acks;
}

}  // namespace nq::streamer
