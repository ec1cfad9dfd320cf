// SlotLoader's load pipeline (slot_loader.h): Pump starts loads into free or evictable slots,
// StartLoad issues a record's reads, CopyIntoSlot / Finish land it in every member's arena and
// publish it, Reap takes the reads that completed. Kept apart from slot_loader.cc, which runs the
// session (routing, refreshes, acks, updates).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/elapsed.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/streamer/slot_loader.h"

namespace nq::streamer {
namespace {

// A record read this long (issue to landing) is a stalled drive, not a busy one: NVMe reads of
// a few MiB take milliseconds, even 32 deep.
constexpr double kSlowReadSeconds = 1.0;

// Whether `update` already makes (layer, slot) READY. Such a slot must not be unmapped in the same
// update: a worker with a slot mailbox takes an update's unmaps before its READYs (each expert
// has one entry there, mailbox_poster.h), so it would keep the expert mapped while the poster
// reports the unmap applied and the slot is reused under it. The victim leaves in a later update.
bool ReadyInUpdate(const nq::v1::SlotTableUpdate& update, uint32_t layer, uint32_t slot) {
  return std::any_of(update.changes().begin(), update.changes().end(), [&](const nq::v1::SlotChange& c) {
    return c.kind() == nq::v1::SlotChange::KIND_READY && c.layer() == layer && c.slot() == slot;
  });
}

}  // namespace

void SlotLoader::Pump(nq::v1::SlotTableUpdate& update) {
  const SlotGeometry& g = worker_->geometry;
  for (auto it = queue_.begin(); it != queue_.end();) {
    const Want want = *it;
    absl::StatusOr<size_t> li = g.LayerIndex(want.layer);
    if (!li.ok() || allocator_.SlotOf(*li, want.expert).has_value() || failed_.count({want.layer, want.expert})) {
      it = queue_.erase(it);  // unknown layer, already present or loading, or known bad
      continue;
    }
    size_t reads = 0;  // members whose record is not in a bounce buffer
    for (const std::shared_ptr<RegisteredWorker>& member : members_) {
      if (member->remote()) continue;  // read by its node's streamer
      reads += cache_.Contains(RecordKey{.rank = member->rank, .layer = want.layer, .expert = want.expert}) ? 0 : 1;
    }
    // A read needs a free bounce buffer and room under the queue depth (4-8 reads per drive keep
    // tail latency low, DESIGN.md section 4); a cached record needs neither, so it is served
    // while reads wait. A group's load is issued whole or not at all.
    if (reads > 0 && (in_flight_.size() + reads > read_depth_ || cache_.idle() < reads)) {
      ++it;
      continue;
    }
    std::optional<uint32_t> slot = allocator_.Reserve(*li, want.expert, want.fixed);
    if (!slot.has_value()) {
      // No FREE slot: unmap the victim now (eager) and wait for the acknowledgement.
      std::optional<uint32_t> victim_slot =
          want.victim == PlannedLoad::kNoVictim ? std::nullopt : allocator_.SlotOf(*li, want.victim);
      const bool victim_ready = !want.fixed && victim_slot && *victim_slot >= g.fixed_slots_per_layer &&
                                allocator_.state(*li, *victim_slot) == SlotState::kReady;
      if (victim_ready && ReadyInUpdate(update, want.layer, *victim_slot)) {
        unmap_deferred_ = true;  // unmapped by the next update (SendThenDeferred)
        ++it;
        continue;
      }
      if (victim_ready) {
        (void)allocator_.MarkUnmapping(*li, *victim_slot);
        nq::v1::SlotChange* change = update.add_changes();
        change->set_kind(nq::v1::SlotChange::KIND_UNMAP);
        change->set_layer(want.layer);
        change->set_slot(*victim_slot);
        metrics_->unmaps.Increment();
        it->victim = PlannedLoad::kNoVictim;
        ++it;
      } else if (allocator_.CountInState(SlotState::kUnmapping) > 0 || !in_flight_.empty() || landing_ > 0 ||
                 !loads_.empty()) {
        ++it;  // a slot frees up when an acknowledgement, a read or a remote rank's answer comes back
      } else {
        it = queue_.erase(it);  // nothing will free a slot for it
      }
      continue;
    }
    StartLoad(*li, *slot, want, update);
    it = queue_.erase(it);
  }
}

void SlotLoader::StartLoad(size_t layer_index, uint32_t slot, const Want& want, nq::v1::SlotTableUpdate& update) {
  const uint64_t id = next_load_++;
  ++reads_done_or_loads_started_;
  GroupLoad load{.layer_index = layer_index, .slot = slot, .want = want};
  // Cache hits first: taking buffers for the reads below may evict a record this load needs.
  std::vector<uint32_t> to_read;
  for (const std::shared_ptr<RegisteredWorker>& member : members_) {
    if (member->remote()) continue;
    const RecordKey key{.rank = member->rank, .layer = want.layer, .expert = want.expert};
    const std::optional<unsigned> buffer = cache_.Lookup(key);
    if (!buffer.has_value()) {
      to_read.push_back(member->rank);
      continue;
    }
    metrics_->cache_hits.Increment();
    {
      absl::MutexLock lock(&mu_);
      ++stats_.cache_hits;
    }
    // Create checked that every member's layers have records of at most a slot.
    const uint64_t bytes = *store_->RecordBytes(member->rank, want.layer);
    if (!load.failed && !CopyIntoSlot(member->rank, layer_index, slot, want, store_->Buffer(*buffer).first(bytes))) {
      load.failed = true;
    }
  }
  for (uint32_t rank : to_read) {
    // Pump checked there are idle buffers for every read.
    const unsigned buffer = *cache_.AcquireForRead();
    const uint64_t tag = next_tag_++;
    absl::Status submitted = store_->Submit(ReadRequest{.rank = rank,
                                                        .layer = want.layer,
                                                        .expert = want.expert,
                                                        .buffer_index = static_cast<int>(buffer),
                                                        .tag = tag});
    if (!submitted.ok()) {
      spdlog::error("worker {}: rank {}'s read of layer {} expert {} not issued: {}", worker_->worker_id, rank,
                    want.layer, want.expert, submitted.ToString());
      cache_.Discard(buffer);
      load.failed = true;
      continue;
    }
    metrics_->cache_misses.Increment();
    {
      absl::MutexLock lock(&mu_);
      ++stats_.disk_reads;
    }
    in_flight_[tag] = Read{.load = id, .rank = rank, .buffer = buffer};
    ++load.outstanding;
  }
  // Remote ranks read their own records on their node; the slot stays LOADING on every rank until
  // all of them answered. A load that already failed here orders nothing.
  for (const std::shared_ptr<RegisteredWorker>& member : members_) {
    if (!member->remote() || load.failed) continue;
    nq::v1::LoadOrder order;
    order.set_load_id(id);
    order.set_layer(want.layer);
    order.set_expert(want.expert);
    order.set_slot(slot);
    if (!member->order_load(order)) {
      spdlog::error("worker {}: rank {}'s link is gone; layer {} expert {} is not loaded", worker_->worker_id,
                    member->rank, want.layer, want.expert);
      load.failed = true;
      continue;
    }
    load.remote_pending.insert(member->rank);
    ++load.outstanding;
  }
  if (load.outstanding == 0) {
    Finish(load, update);
  } else {
    loads_.emplace(id, std::move(load));
  }
}

bool SlotLoader::CopyIntoSlot(uint32_t rank, size_t layer_index, uint32_t slot, const Want& want,
                              std::span<const std::byte> record) {
  const SlotGeometry& g = worker_->geometry;
  // The invariant of DESIGN.md section 4: only a slot no rank maps is written.
  if (!allocator_.Writable(layer_index, slot)) {
    spdlog::critical("worker {}: layer {} slot {} is not LOADING; load dropped", worker_->worker_id, want.layer, slot);
    return false;
  }
  absl::Status written = Member(rank)->arena->Write(g.SlotOffset(layer_index, slot), record);
  if (!written.ok()) {
    spdlog::error("worker {}: copy into rank {}'s layer {} slot {} failed: {}", worker_->worker_id, rank, want.layer,
                  slot, written.ToString());
    return false;
  }
  return true;
}

void SlotLoader::Finish(const GroupLoad& load, nq::v1::SlotTableUpdate& update) {
  const SlotGeometry& g = worker_->geometry;
  const Want& want = load.want;
  if (load.cancelled && !load.failed) {
    // Unwanted since it started; what it wrote is never announced, so the slot is simply FREE.
    (void)allocator_.Release(load.layer_index, load.slot);
    return;
  }
  if (load.failed) {
    // Some rank lacks the bytes: no rank hears of the load, so none runs the expert at 4 bits.
    (void)allocator_.Release(load.layer_index, load.slot);
    failed_.insert({want.layer, want.expert});
    metrics_->loads_failed.Increment();
    absl::MutexLock lock(&mu_);
    ++stats_.loads_failed;
    stats_.cached_records = cache_.records();
    return;
  }
  // Write returns once the worker would read the new bytes (device arenas: the copy is
  // complete on the device), so this is decision to usable.
  metrics_->load_latency.Observe(SecondsSince(want.decided));
  (void)allocator_.MarkReady(load.layer_index, load.slot);
  nq::v1::SlotChange* ready = update.add_changes();
  ready->set_kind(nq::v1::SlotChange::KIND_READY);
  ready->set_layer(want.layer);
  ready->set_slot(load.slot);
  ready->set_expert(want.expert);
  // Lazy eviction: the victim leaves in the update that makes its replacement READY.
  if (want.victim != PlannedLoad::kNoVictim) {
    std::optional<uint32_t> victim = allocator_.SlotOf(load.layer_index, want.victim);
    const bool victim_ready = victim && *victim >= g.fixed_slots_per_layer &&
                              allocator_.state(load.layer_index, *victim) == SlotState::kReady;
    if (victim_ready && ReadyInUpdate(update, want.layer, *victim)) {
      deferred_victims_.emplace_back(load.layer_index, want.victim);  // SendThenDeferred unmaps it
    } else if (victim_ready) {
      (void)allocator_.MarkUnmapping(load.layer_index, *victim);
      nq::v1::SlotChange* unmap = update.add_changes();
      unmap->set_kind(nq::v1::SlotChange::KIND_UNMAP);
      unmap->set_layer(want.layer);
      unmap->set_slot(*victim);
      metrics_->unmaps.Increment();
    }
  }
  metrics_->loads_ready.Increment();
  if (want.hinted) {
    metrics_->hint_loads_ready.Increment();
    metrics_->hint_load_latency.Observe(SecondsSince(want.hinted_at));
  }
  absl::MutexLock lock(&mu_);
  ++stats_.loads_ready;
  if (want.hinted) ++stats_.hint_loads_ready;
  // With the load counts, so a reader of both sees the cache as this load left it.
  stats_.cached_records = cache_.records();
}

void SlotLoader::Reap() {
  absl::StatusOr<std::vector<RecordCompletion>> done = store_->Poll();
  if (!done.ok()) {
    spdlog::error("worker {}: record store: {}", worker_->worker_id, done.status().ToString());
    return;
  }
  if (done->empty()) return;
  reads_done_or_loads_started_ += done->size();
  std::vector<std::pair<Read, const RecordCompletion*>> landed;
  for (const RecordCompletion& completion : *done) {
    auto found = in_flight_.find(completion.tag);
    if (found == in_flight_.end()) continue;
    landed.emplace_back(found->second, &completion);
    in_flight_.erase(found);
  }
  nq::v1::SlotTableUpdate update;
  // Refill the ring before copying: the reads just reaped left room under the queue depth, and
  // other idle bounce buffers take the next reads (their own stay busy until copied), so the
  // drive keeps working while this thread copies into slots.
  landing_ = landed.size();
  if (!session_gone_) Pump(update);
  landing_ = 0;
  static LogRateLimiter failure_log(std::chrono::seconds(10));
  for (const auto& [read, done_read] : landed) {
    const RecordCompletion& completion = *done_read;
    auto load = loads_.find(read.load);
    const Want* want = load == loads_.end() ? nullptr : &load->second.want;
    if (completion.injected_slow) metrics_->slow_reads_injected.Increment();
    if (completion.latency_seconds >= kSlowReadSeconds) metrics_->slow_reads.Increment();
    // Only a record that landed whole and matched its checksum in the index (OK) is kept; a
    // failed, short or corrupt read leaves its buffer empty.
    if (completion.status.ok() && want != nullptr) {
      cache_.Fill(read.buffer, RecordKey{.rank = read.rank, .layer = want->layer, .expert = want->expert});
      metrics_->read_bytes.Increment(static_cast<double>(completion.bytes));
      metrics_->read_latency.Observe(completion.latency_seconds);
      pacer_.OnReadLanded(completion.latency_seconds);
    } else {
      cache_.Discard(read.buffer);
    }
    if (read.cancelled || load == loads_.end()) {
      // Its slot was freed when it was cancelled; it is never copied or announced.
      if (completion.status.ok()) {
        absl::MutexLock lock(&mu_);
        ++stats_.cancelled_reads_landed;
      }
      continue;
    }
    GroupLoad& group_load = load->second;
    if (!completion.status.ok()) {
      group_load.failed = true;
      metrics_->read_errors.WithLabels({completion.failure.empty() ? "other" : completion.failure}).Increment();
      if (long n = failure_log.Allow()) {
        spdlog::error("worker {}: rank {}'s record of layer {} expert {} failed, the expert stays at 2 bits on every "
                      "rank: {} ({} failures since last report)",
                      worker_->worker_id, read.rank, want->layer, want->expert, completion.status.ToString(), n);
      }
    } else if (!group_load.failed && !group_load.cancelled && !session_gone_ &&
               !CopyIntoSlot(read.rank, group_load.layer_index, group_load.slot, group_load.want,
                             store_->Buffer(read.buffer).first(completion.bytes))) {
      group_load.failed = true;
    }
    if (--group_load.outstanding > 0) continue;
    if (!session_gone_) Finish(group_load, update);
    loads_.erase(load);
  }
  // The landed reads' buffers are free or cached only now: a load that waited for one in the
  // Pump above starts here, not a wake-up (max_sleep) later.
  if (!session_gone_ && !queue_.empty()) Pump(update);
  SendThenDeferred(std::move(update), /*always=*/false);
}

}  // namespace nq::streamer
