#include "services/worker/slot_runtime.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"
#include "services/common/logging.h"
#include "services/common/metrics/buckets.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

uint64_t HashBytes(std::span<const std::byte> bytes) {
  return absl::HashOf(absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

}  // namespace

model::Model::SlotArena ModelSlotArena(const SlotGeometry& geometry, const std::byte* base) {
  model::Model::SlotArena arena{.base = base,
                                .slot_bytes = static_cast<int64_t>(geometry.slot_stride_bytes),
                                .slots_per_layer = geometry.slots_per_layer};
  for (size_t i = 0; i < geometry.moe_layer_ids.size(); ++i) {
    arena.layer_offsets[geometry.moe_layer_ids[i]] = geometry.SlotOffset(i, 0);
  }
  return arena;
}

SlotRuntime::SlotRuntime(SlotTable* table, std::span<const std::byte> arena,
                         const release::ReleaseExpertDecoder* decoder, SlotRuntimeOptions options)
    : table_(table),
      arena_(arena),
      decoder_(decoder),
      options_(options),
      calls_4bit_(metrics::Registry::Default()
                      .Counter("nq_expert_calls_total",
                               "Routed expert calls (token x expert), by the precision they ran at (4: the "
                               "residual was READY in a slot)",
                               {"bits"})
                      .WithLabels({"4"})),
      calls_2bit_(metrics::Registry::Default().Counter("nq_expert_calls_total", "", {"bits"}).WithLabels({"2"})),
      updates_applied_(metrics::Registry::Default()
                           .Counter("nq_worker_slot_updates_applied_total",
                                    "Slot-table updates applied at a step boundary")
                           .Get()),
      updates_rejected_(metrics::Registry::Default()
                            .Counter("nq_worker_slot_updates_rejected_total",
                                     "Slot-table updates rejected as protocol violations")
                            .Get()),
      integrity_counter_(metrics::Registry::Default()
                             .Counter("nq_worker_slot_integrity_failures_total",
                                      "READY slots whose bytes differed from their record or changed while mapped (--verify_slots)")
                             .Get()),
      slots_ready_(metrics::Registry::Default()
                       .Gauge("nq_worker_slots_ready", "Slots holding a READY residual")
                       .Get()),
      wait_seconds_(metrics::Registry::Default()
                        .Histogram("nq_worker_slot_wait_seconds",
                                   "Time a step of a request's first tokens waited for announced loads",
                                   metrics::ExponentialBuckets(1e-4, 2, 14))
                        .Get()) {
  if (options_.mailbox != nullptr) {
    mailbox_seen_.assign(static_cast<size_t>(options_.mailbox->layers()) * options_.mailbox->experts(),
                         kernels::kMailboxEmptyEntry);
  }
}

void SlotRuntime::SetAckSink(std::function<void(nq::v1::UnmapAck)> sink) {
  absl::MutexLock lock(&pending_mu_);
  ack_sink_ = std::move(sink);
}

void SlotRuntime::Post(nq::v1::SlotTableUpdate update) {
  const GroupRole role = role_.load();
  {
    absl::MutexLock lock(&pending_mu_);
    if (role == GroupRole::kFollower || awaiting_hello_) {
      // A follower's updates come with the leader's step commands; after a reset, the session's
      // updates describe a table this rank no longer holds.
      static LogRateLimiter ignored_log(std::chrono::seconds(10));
      if (long n = ignored_log.Allow()) {
        spdlog::warn("slot-table update generation {} from the streamer ignored ({}; {} since last report)",
                     update.generation(),
                     role == GroupRole::kFollower ? "a follower rank applies its leader's" : "awaiting a new session",
                     n);
      }
      return;
    }
    if (options_.mailbox != nullptr && update.changes_size() > 0) {
      updates_rejected_.Increment();
      spdlog::error("slot-table update generation {} carries {} changes; this worker takes them through its slot "
                    "mailbox: refused",
                    update.generation(), update.changes_size());
      return;
    }
    pending_.push_back(std::move(update));
  }
  // A group's leader applies only at its steps' start, so the update rides the step command.
  if (role == GroupRole::kNone) TryApplyNow();
}

void SlotRuntime::SetGroupRole(GroupRole role) { role_.store(role); }

std::vector<nq::v1::SlotTableUpdate> SlotRuntime::TakeRelayed() {
  absl::MutexLock lock(&pending_mu_);
  return std::exchange(relayed_, {});
}

bool SlotRuntime::ResetForNewGroup() {
  absl::MutexLock step(&step_mu_);
  absl::MutexLock lock(&pending_mu_);
  if (table_->applied_generation() == 0 && table_->ReadySlots().empty() && relayed_.empty()) {
    // Nothing applied yet: every rank starts from this empty table; queued updates stay.
    return false;
  }
  spdlog::info("slot table cleared for a newly formed tensor-parallel group ({} READY slots, generation {}, {} "
               "updates not yet applied dropped)",
               table_->ReadySlots().size(), table_->applied_generation(), pending_.size());
  table_->Clear();
  pending_.clear();
  relayed_.clear();
  awaiting_hello_ = true;
  loads_in_flight_.store(0);
  table_version_.fetch_add(1);
  slot_hash_.clear();
  ready_count_.store(0);
  slots_ready_.Set(0);
  return true;
}

void SlotRuntime::BeginRelayedStep(uint32_t request_token, std::span<const nq::v1::SlotTableUpdate> updates) {
  BeginStep(request_token);
  for (const nq::v1::SlotTableUpdate& update : updates) Apply(update);
}

void SlotRuntime::TryApplyNow() {
  while (step_mu_.TryLock()) {
    ApplyPending();
    // An idle worker runs no forward to apply what the streamer posted (the update was its
    // doorbell): publish it from here, so the streamer can reuse the slots it unmapped.
    if (options_.mailbox != nullptr) SyncWithMailbox(/*apply_on_host=*/true);
    step_mu_.Unlock();
    // An update posted between ApplyPending and Unlock found the gate held: take it again.
    absl::MutexLock lock(&pending_mu_);
    if (pending_.empty()) return;
  }
  // A step runs: it applies at its end.
}

std::pair<std::vector<nq::v1::SlotEntry>, uint64_t> SlotRuntime::SnapshotForHello() {
  absl::MutexLock step(&step_mu_);
  {
    absl::MutexLock lock(&pending_mu_);
    if (!pending_.empty()) {
      spdlog::info("dropping {} slot-table updates of the previous streamer session", pending_.size());
      pending_.clear();
    }
    awaiting_hello_ = false;
  }
  loads_in_flight_.store(0);
  // Whatever the previous session posted is published before the new one adopts the table, so
  // its posts continue from rows this worker already holds.
  if (options_.mailbox != nullptr) SyncWithMailbox(/*apply_on_host=*/true);
  return {table_->ReadySlots(), table_->applied_generation()};
}

void SlotRuntime::BeginStep(uint32_t request_token) {
  step_mu_.Lock();
  current_step_.store(request_token);
  ApplyPending();
  if (request_token < options_.wait_tokens && options_.wait_per_step > absl::ZeroDuration() && loads_in_flight_.load() > 0) {
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + options_.wait_per_step;
    while (loads_in_flight_.load() > 0) {
      {
        absl::MutexLock lock(&pending_mu_);
        auto has_pending = [this]() ABSL_SHARED_LOCKS_REQUIRED(pending_mu_) { return !pending_.empty(); };
        if (!pending_mu_.AwaitWithDeadline(absl::Condition(&has_pending), deadline)) break;
      }
      ApplyPending();
    }
    wait_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  }
  steps_.fetch_add(1);
}

void SlotRuntime::EndStep() {
  // First what the step's forwards applied: a slot they unmapped may be rewritten already, so its
  // hash goes before VerifySlots looks.
  if (options_.mailbox != nullptr) SyncWithMailbox(/*apply_on_host=*/false);
  if (options_.verify_slots) VerifySlots();
  // A group's leader applies at the next step's start, where the command relays it.
  const bool apply_now = role_.load() == GroupRole::kNone;
  if (apply_now) ApplyPending();
  step_mu_.Unlock();
  if (!apply_now) return;
  bool more;
  {
    absl::MutexLock lock(&pending_mu_);
    more = !pending_.empty();
  }
  if (more) TryApplyNow();
}

void SlotRuntime::ApplyPending() {
  std::deque<nq::v1::SlotTableUpdate> updates;
  {
    absl::MutexLock lock(&pending_mu_);
    updates.swap(pending_);
  }
  for (const nq::v1::SlotTableUpdate& update : updates) Apply(update);
}

absl::StatusOr<std::vector<std::byte>> SlotRuntime::SlotBytes(uint32_t layer, uint32_t slot) const {
  const SlotGeometry& g = table_->geometry();
  const size_t layer_index = *g.LayerIndex(layer);
  uint64_t bytes = g.rec_bytes;
  if (decoder_ != nullptr) {
    if (absl::StatusOr<uint64_t> rec = decoder_->RecordBytes(layer); rec.ok()) bytes = *rec;
  }
  const uint64_t offset = g.SlotOffset(layer_index, slot);
  std::vector<std::byte> copy(bytes);
  if (!arena_.empty()) {
    const std::span<const std::byte> source = arena_.subspan(offset, bytes);
    std::copy(source.begin(), source.end(), copy.begin());
  } else if (options_.read_arena) {
    RETURN_IF_ERROR(options_.read_arena(offset, copy));
  } else {
    return absl::FailedPreconditionError("the slot arena cannot be read from the host");
  }
  return copy;
}

void SlotRuntime::CountIntegrityFailure() {
  integrity_failures_.fetch_add(1);
  integrity_counter_.Increment();
}

void SlotRuntime::CheckAgainstRecord(uint32_t layer, uint32_t slot, uint32_t expert) {
  absl::StatusOr<std::vector<std::byte>> held = SlotBytes(layer, slot);
  if (!held.ok()) {
    spdlog::error("--verify_slots: layer {} slot {}: {}", layer, slot, held.status().ToString());
    return;
  }
  slot_hash_[{layer, slot}] = HashBytes(*held);
  if (decoder_ == nullptr) return;
  absl::StatusOr<std::vector<std::byte>> record = decoder_->ReadRecord(layer, expert);
  if (!record.ok()) {
    spdlog::error("--verify_slots: record of layer {} expert {}: {}", layer, expert, record.status().ToString());
    return;
  }
  if (*record == *held) return;
  CountIntegrityFailure();
  spdlog::critical("layer {} slot {} was announced READY for expert {} but does not hold its record", layer, slot,
                   expert);
}

void SlotRuntime::Apply(const nq::v1::SlotTableUpdate& update) {
  if (options_.mailbox != nullptr) {
    // A doorbell (Post refused any with changes): its loads_in_flight is all it carries.
    loads_in_flight_.store(update.loads_in_flight());
    return;
  }
  if (update.generation() <= table_->applied_generation()) return;  // stale or duplicate
  std::vector<nq::v1::SlotRef> unmapped;
  if (absl::Status s = table_->ApplyAtStepBoundary(update, &unmapped); !s.ok()) {
    updates_rejected_.Increment();
    spdlog::error("rejected slot-table update generation {}: {}", update.generation(), s.ToString());
    return;
  }
  updates_applied_.Increment();
  table_version_.fetch_add(1);
  if (const GroupRole role = role_.load(); role != GroupRole::kNone) {
    if (role == GroupRole::kLeader) {
      absl::MutexLock lock(&pending_mu_);
      relayed_.push_back(update);
    }
    // The same line on every rank of the group (tests compare them): a rank that applied
    // another table, or at another step, would show it here.
    spdlog::info("slot table generation {} applied before step {}: {} READY slots, digest {:016x}",
                 update.generation(), current_step_.load(), table_->ReadySlots().size(), table_->Digest());
  }
  loads_in_flight_.store(update.loads_in_flight());
  if (options_.verify_slots) {
    for (const nq::v1::SlotChange& change : update.changes()) {
      if (change.kind() == nq::v1::SlotChange::KIND_READY) CheckAgainstRecord(change.layer(), change.slot(), change.expert());
    }
  }
  // After the READY checks: one update can make a slot READY and unmap it again (the streamer's
  // next load took it as its victim before the update went out). The slot is acknowledged below
  // and the streamer may write it at once, so its hash must not outlive this update.
  for (const nq::v1::SlotRef& ref : unmapped) slot_hash_.erase({ref.layer(), ref.slot()});
  ready_count_.store(decoder_ == nullptr ? 0 : table_->ReadySlots().size());
  slots_ready_.Set(static_cast<double>(table_->ReadySlots().size()));
  if (unmapped.empty()) return;
  nq::v1::UnmapAck ack;
  ack.set_generation(update.generation());
  ack.set_step(steps_.load());
  for (nq::v1::SlotRef& ref : unmapped) *ack.add_slots() = std::move(ref);
  std::function<void(nq::v1::UnmapAck)> sink;
  {
    absl::MutexLock lock(&pending_mu_);
    sink = ack_sink_;
  }
  if (sink) sink(std::move(ack));
}

// Any thread, between steps too (nq kld's statistics): like SlotFor it reads only the
// SlotTable, under the table's own mutex, and decoder_ is const. (It once also read a map of
// decoded weights without a lock; that map went with issue #12, issue #22 checked the rest.)
// During a step the answer is stable, as updates wait for EndStep; between steps two calls may
// straddle an update, which statistics tolerate.
bool SlotRuntime::RunsAtFourBit(int64_t layer, int32_t expert) const {
  return decoder_ != nullptr &&
         table_->SlotOf(static_cast<uint32_t>(layer), static_cast<uint32_t>(expert)).has_value();
}

bool SlotRuntime::CopyReadyResidual(int64_t layer, int32_t expert, std::span<std::byte> out) const {
  if (decoder_ == nullptr) return false;
  if (options_.mailbox != nullptr) return CopyPublishedResidual(layer, expert, out);
  const std::optional<uint32_t> slot = table_->SlotOf(static_cast<uint32_t>(layer), static_cast<uint32_t>(expert));
  if (!slot.has_value()) return false;
  absl::StatusOr<std::vector<std::byte>> bytes = SlotBytes(static_cast<uint32_t>(layer), *slot);
  if (!bytes.ok() || bytes->size() != out.size()) return false;
  std::copy(bytes->begin(), bytes->end(), out.begin());
  return true;
}

int32_t SlotRuntime::SlotFor(int64_t layer, int32_t expert, int64_t tokens) {
  std::optional<uint32_t> slot;
  if (decoder_ != nullptr) slot = table_->SlotOf(static_cast<uint32_t>(layer), static_cast<uint32_t>(expert));
  (slot.has_value() ? calls_4bit_ : calls_2bit_).Increment(static_cast<double>(tokens));
  return slot.has_value() ? static_cast<int32_t>(*slot) : -1;
}

bool SlotRuntime::RunsAtFourBitNow(int64_t layer, int32_t expert) const {
  if (options_.mailbox == nullptr) return RunsAtFourBit(layer, expert);
  if (decoder_ == nullptr || expert < 0 || static_cast<uint32_t>(expert) >= options_.mailbox->experts()) return false;
  absl::StatusOr<size_t> li = table_->geometry().LayerIndex(static_cast<uint32_t>(layer));
  if (!li.ok()) return false;
  return kernels::MailboxEntrySlot(options_.mailbox->Published(*li, static_cast<uint32_t>(expert))) >= 0;
}

void SlotRuntime::NoteLayerRan(int64_t layer) {
  if (options_.mailbox == nullptr || !table_->geometry().LayerIndex(static_cast<uint32_t>(layer)).ok()) return;
  std::vector<uint8_t>& row = ran_rows_[layer];
  row.assign(options_.mailbox->experts(), 0);
  for (uint32_t e = 0; e < row.size(); ++e) row[e] = RunsAtFourBitNow(layer, static_cast<int32_t>(e)) ? 1 : 0;
}

model::Model::ExpertSlotTables SlotRuntime::SlotTables() {
  return {
      .generation = [this] { return table_version_.load(); },
      .fill =
          [this](int64_t layer, std::span<int32_t> slot_of_expert) {
            for (size_t e = 0; e < slot_of_expert.size(); ++e) {
              std::optional<uint32_t> slot;
              if (decoder_ != nullptr) slot = table_->SlotOf(static_cast<uint32_t>(layer), static_cast<uint32_t>(e));
              slot_of_expert[e] = slot.has_value() ? static_cast<int32_t>(*slot) : -1;
            }
          },
      .count =
          [this](int64_t layer, const model::MoeRouting& routing) {
            // Mailbox mode: the slots the layer ran with are what the model published (the host
            // table catches up only at the step's end), or what NoteLayerRan kept when the model
            // applied again after this layer.
            const auto ran = ran_rows_.find(layer);
            auto four_bit = [&](int32_t expert) {
              if (ran != ran_rows_.end()) {
                return expert >= 0 && static_cast<size_t>(expert) < ran->second.size() && ran->second[expert] != 0;
              }
              return options_.mailbox != nullptr ? RunsAtFourBitNow(layer, expert) : RunsAtFourBit(layer, expert);
            };
            uint64_t four = 0;
            for (int32_t expert : routing.experts) four += four_bit(expert) ? 1 : 0;
            if (ran != ran_rows_.end()) ran_rows_.erase(ran);
            if (four > 0) calls_4bit_.Increment(static_cast<double>(four));
            if (routing.experts.size() > four) calls_2bit_.Increment(static_cast<double>(routing.experts.size() - four));
          },
  };
}

bool SlotRuntime::CopyPublishedResidual(int64_t layer, int32_t expert, std::span<std::byte> out) const {
  // A forward of this very step may unmap the slot and the streamer rewrite it at once: copy,
  // then keep the bytes only if the published entry did not move meanwhile (the streamer writes a
  // slot only after the unmap that frees it is published).
  const absl::StatusOr<size_t> li = table_->geometry().LayerIndex(static_cast<uint32_t>(layer));
  if (!li.ok() || expert < 0 || static_cast<uint32_t>(expert) >= options_.mailbox->experts()) return false;
  const uint64_t before = options_.mailbox->Published(*li, static_cast<uint32_t>(expert));
  const int32_t slot = kernels::MailboxEntrySlot(before);
  if (slot < 0 || static_cast<uint32_t>(slot) >= table_->geometry().slots_per_layer) return false;
  absl::StatusOr<std::vector<std::byte>> bytes = SlotBytes(static_cast<uint32_t>(layer), static_cast<uint32_t>(slot));
  if (!bytes.ok() || bytes->size() != out.size()) return false;
  if (options_.mailbox->Published(*li, static_cast<uint32_t>(expert)) != before) return false;
  std::copy(bytes->begin(), bytes->end(), out.begin());
  return true;
}

void SlotRuntime::SyncWithMailbox(bool apply_on_host) {
  SlotMailbox& mailbox = *options_.mailbox;
  if (apply_on_host) mailbox.ApplyOnHost();
  const SlotGeometry& g = table_->geometry();
  nq::v1::SlotTableUpdate update;
  std::vector<nq::v1::SlotChange> ready;
  std::vector<std::pair<size_t, uint64_t>> seen;
  for (size_t li = 0; li < mailbox.layers(); ++li) {
    for (uint32_t e = 0; e < mailbox.experts(); ++e) {
      const size_t k = li * mailbox.experts() + e;
      const uint64_t now = mailbox.Published(li, e);
      if (now == mailbox_seen_[k]) continue;
      const int32_t before = kernels::MailboxEntrySlot(mailbox_seen_[k]), after = kernels::MailboxEntrySlot(now);
      seen.emplace_back(k, now);
      if (before == after) continue;  // posted again, same row
      if (before >= 0) {
        nq::v1::SlotChange& unmap = *update.add_changes();
        unmap.set_kind(nq::v1::SlotChange::KIND_UNMAP);
        unmap.set_layer(g.moe_layer_ids[li]);
        unmap.set_slot(static_cast<uint32_t>(before));
      }
      if (after >= 0) {
        nq::v1::SlotChange& map = ready.emplace_back();
        map.set_kind(nq::v1::SlotChange::KIND_READY);
        map.set_layer(g.moe_layer_ids[li]);
        map.set_slot(static_cast<uint32_t>(after));
        map.set_expert(e);
      }
    }
  }
  if (seen.empty()) return;
  for (const auto& [k, entry] : seen) mailbox_seen_[k] = entry;
  if (update.changes_size() == 0 && ready.empty()) return;
  // Unmaps first: a slot freed for one expert may hold another in the same sync.
  for (nq::v1::SlotChange& change : ready) *update.add_changes() = std::move(change);
  update.set_generation(table_->applied_generation() + 1);
  std::vector<nq::v1::SlotRef> unmapped;
  if (absl::Status s = table_->ApplyAtStepBoundary(update, &unmapped); !s.ok()) {
    updates_rejected_.Increment();
    spdlog::error("slot mailbox: the published rows do not follow from the table ({}); rebuilding it from them",
                  s.ToString());
    RebuildFromMailbox();
    return;
  }
  updates_applied_.Increment();
  table_version_.fetch_add(1);
  for (const nq::v1::SlotRef& ref : unmapped) slot_hash_.erase({ref.layer(), ref.slot()});
  if (options_.verify_slots) {
    for (const nq::v1::SlotChange& change : update.changes()) {
      if (change.kind() == nq::v1::SlotChange::KIND_READY) CheckAgainstRecord(change.layer(), change.slot(), change.expert());
    }
  }
  ready_count_.store(decoder_ == nullptr ? 0 : table_->ReadySlots().size());
  slots_ready_.Set(static_cast<double>(table_->ReadySlots().size()));
}

void SlotRuntime::RebuildFromMailbox() {
  SlotMailbox& mailbox = *options_.mailbox;
  const SlotGeometry& g = table_->geometry();
  const uint64_t generation = table_->applied_generation() + 1;
  table_->Clear();
  slot_hash_.clear();
  nq::v1::SlotTableUpdate update;
  update.set_generation(generation);
  for (size_t li = 0; li < mailbox.layers(); ++li) {
    for (uint32_t e = 0; e < mailbox.experts(); ++e) {
      mailbox_seen_[li * mailbox.experts() + e] = mailbox.Published(li, e);
      const int32_t slot = kernels::MailboxEntrySlot(mailbox_seen_[li * mailbox.experts() + e]);
      if (slot < 0) continue;
      nq::v1::SlotChange& map = *update.add_changes();
      map.set_kind(nq::v1::SlotChange::KIND_READY);
      map.set_layer(g.moe_layer_ids[li]);
      map.set_slot(static_cast<uint32_t>(slot));
      map.set_expert(e);
    }
  }
  if (absl::Status s = table_->ApplyAtStepBoundary(update, nullptr); !s.ok()) {
    // Two experts on one slot, or a slot out of range: the streamer broke the protocol. The table
    // stays empty (every expert at 2 bits on the host's books; the device follows the mailbox).
    CountIntegrityFailure();
    spdlog::critical("slot mailbox: the published rows are inconsistent: {}", s.ToString());
  }
  table_version_.fetch_add(1);
  ready_count_.store(decoder_ == nullptr ? 0 : table_->ReadySlots().size());
  slots_ready_.Set(static_cast<double>(table_->ReadySlots().size()));
}

void SlotRuntime::VerifySlots() {
  for (const auto& [key, hash] : slot_hash_) {
    absl::StatusOr<std::vector<std::byte>> held = SlotBytes(key.first, key.second);
    if (!held.ok() || HashBytes(*held) == hash) continue;
    CountIntegrityFailure();
    spdlog::critical("layer {} slot {} changed while READY: the streamer wrote a mapped slot", key.first, key.second);
  }
}


}  // namespace nq::worker
