// The worker's side of the slot protocol at run time (DESIGN.md sections 3-4). Slot-table
// updates from the streamer are applied only between decode steps; an expert runs at 4 bits
// exactly when its residual sits in a READY slot (the kernels read the slot's bytes in place,
// kernels/nq_moe.h), and at 2 bits otherwise. Unmaps are acknowledged with the step number.
//
//   decode loop:   runtime.BeginStep(i);  model.Forward(...);  runtime.EndStep();
//   session:       runtime.Post(update);   // applied now if no step runs, else at EndStep
//   model hook:    model.SetExpertSlotTables(runtime.SlotTables());
//
// A step holds the step gate from BeginStep to EndStep; updates are applied under it, so a
// step never sees the table, or a slot's bytes, change.
//
// In a tensor-parallel group (issue #18) every rank must apply the same updates before the same
// step. The streamer sends the group's updates to rank 0 only; rank 0 (GroupRole::kLeader)
// applies them only at BeginStep, never between requests, and hands each applied update to the
// next step command (TakeRelayed); the other ranks (kFollower) apply the command's updates
// before running it (BeginRelayedStep) and send their own unmap acks. Each applied update is
// logged with its step and the table's digest, the same line on every rank.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "nq/v1/streamer.pb.h"
#include "services/common/metrics/registry.h"
#include "services/common/slot_mailbox.h"
#include "services/model/model.h"
#include "services/release/release_expert_decoder.h"
#include "services/worker/slot_table.h"

namespace nq::worker {

struct SlotRuntimeOptions {
  // Bounded wait: during a request's first `wait_tokens` steps, a step waits up to
  // `wait_per_step` for loads the streamer announced (SlotTableUpdate.loads_in_flight).
  uint32_t wait_tokens = 0;
  absl::Duration wait_per_step = absl::ZeroDuration();
  // Check every slot announced READY against its record in the release, and re-hash every
  // READY slot after each step, counting any difference (a bad copy, or a slot written while
  // mapped). Costs a read of each loaded record and a pass over the READY slots; for tests,
  // stress runs and debugging.
  bool verify_slots = false;
  // How verification reads an arena that is not host memory (a device arena: a copy to the
  // host). Unused when the runtime is given a host view.
  std::function<absl::Status(uint64_t offset, std::span<std::byte> out)> read_arena;
  // The worker's slot mailbox (services/common/slot_mailbox.h), when the model applies slot-table
  // changes inside its steps (Model::SetSlotMailbox). The table then follows what the mailbox
  // published: read after every step, and applied on the host (while no step runs) when an
  // update arrives, as the doorbell it then is; updates carrying changes are refused, and unmaps
  // are not acknowledged (the streamer reads them in the mailbox). Not with a GroupRole.
  SlotMailbox* mailbox = nullptr;
};

// The model's view of a slot arena of this geometry starting at `base` (memory of the model's
// backend kind): each MoE layer's row of slots, slot_stride_bytes apart.
model::Model::SlotArena ModelSlotArena(const SlotGeometry& geometry, const std::byte* base);

class SlotRuntime {
 public:
  enum class GroupRole { kNone, kLeader, kFollower };

  // `arena`: this worker's host view of its slot arena (for --verify_slots; empty when the
  // arena lives in device memory, which options.read_arena then reads). `decoder` (the served release) gives record sizes; it may
  // be null: the table is still kept, but every expert runs at 2 bits.
  SlotRuntime(SlotTable* table, std::span<const std::byte> arena, const release::ReleaseExpertDecoder* decoder,
              SlotRuntimeOptions options = {});

  // --- The session thread.
  void Post(nq::v1::SlotTableUpdate update);
  // Where UnmapAcks go (the session's writer). Called from whichever thread applies.
  void SetAckSink(std::function<void(nq::v1::UnmapAck)> sink);
  // For a new session's hello: waits for the running step to end, drops updates of the old
  // session not yet applied (the new streamer session starts from this table), and returns the
  // READY slots and the applied generation.
  std::pair<std::vector<nq::v1::SlotEntry>, uint64_t> SnapshotForHello();

  // --- Tensor parallelism. Set once, before the first step.
  void SetGroupRole(GroupRole role);
  // Leader: the updates applied since the last call, in order, for the step command that follows.
  std::vector<nq::v1::SlotTableUpdate> TakeRelayed();
  // A newly formed group (leader: its manager formed it; follower: it joined): every rank's
  // table must start equal, so a table that holds anything is cleared, updates not yet applied
  // or relayed are dropped, and the session's updates are ignored until its next hello. Returns
  // whether it cleared anything (the leader then registers with the streamer again, so the
  // streamer adopts the empty table). Between steps only.
  bool ResetForNewGroup();

  // --- The decode loop. `request_token`: the step's index within its request (0 = prefill).
  void BeginStep(uint32_t request_token);
  // Follower: BeginStep, then the leader's `updates` for this step (step_command.h).
  void BeginRelayedStep(uint32_t request_token, std::span<const nq::v1::SlotTableUpdate> updates);
  void EndStep();
  // The slot (of the layer's row in the arena) holding (layer, expert)'s READY residual, or -1
  // (2 bits). Only during a step. Counts `tokens` expert calls at 4 or 2 bits.
  int32_t SlotFor(int64_t layer, int32_t expert, int64_t tokens);
  model::Model::ExpertSlotSource SlotSource() {
    return [this](int64_t layer, int32_t expert, int64_t tokens) { return SlotFor(layer, expert, tokens); };
  }
  // The whole-table form the model keeps on its backend (Model::ExpertSlotTables): the version
  // moves with every applied update, fill gives a layer's row, count tallies a forward's calls at
  // 4 and 2 bits as SlotFor does. During a step only.
  model::Model::ExpertSlotTables SlotTables();

  // Copies (layer, expert)'s READY residual (its record's bytes) into `out` and returns true;
  // false when no READY slot holds it or the slot cannot be read. Only during a step (a
  // layer-major prefill borrows what the slots already hold, PrefillExpertsOptions::copy_ready).
  bool CopyReadyResidual(int64_t layer, int32_t expert, std::span<std::byte> out) const;

  // Whether (layer, expert) runs at 4 bits now. During a step (stable), or for statistics
  // between steps. Counts nothing.
  bool RunsAtFourBit(int64_t layer, int32_t expert) const;
  // Whether (layer, expert) would run at 4 bits in a layer running now, mid-forward: with a slot
  // mailbox, what the model's last apply published (with a lookahead observer it applies before
  // every MoE layer); otherwise RunsAtFourBit (the table holds still through a step).
  // For the gate-lookahead counts (lookahead_reporter.h). Counts nothing.
  bool RunsAtFourBitNow(int64_t layer, int32_t expert) const;
  // Mailbox mode with a lookahead observer, where the model applies the mailbox before every MoE
  // layer: called right after `layer` ran (Model::SetLookaheadObserver's layer_ran, before the
  // next apply), it keeps which experts the layer ran at 4 bits, so the forward's call counts
  // (SlotTables' count) judge each layer by the table it ran with. A no-op otherwise.
  void NoteLayerRan(int64_t layer);
  // SlotTableUpdate.loads_in_flight of the last applied update.
  uint32_t loads_in_flight() const { return loads_in_flight_.load(); }

  const SlotTable& table() const { return *table_; }
  uint64_t steps() const { return steps_.load(); }
  // READY slots whose bytes differed from their record or changed while READY (verify_slots
  // only); must stay 0.
  uint64_t integrity_failures() const { return integrity_failures_.load(); }
  // READY slots the model may read (what the last applied update left).
  uint64_t ready_slots() const { return ready_count_.load(); }

 private:
  void ApplyPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  void Apply(const nq::v1::SlotTableUpdate& update) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // Applies now unless a step runs (which then applies at its end).
  void TryApplyNow();
  // A copy of the slot's record-sized bytes, through the host view or options_.read_arena.
  absl::StatusOr<std::vector<std::byte>> SlotBytes(uint32_t layer, uint32_t slot) const;
  // verify_slots: whether the slot holds the expert's record; counts and logs a difference.
  void CheckAgainstRecord(uint32_t layer, uint32_t slot, uint32_t expert);
  void CountIntegrityFailure();
  void VerifySlots() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // Mailbox mode's CopyReadyResidual: the published slot's bytes, kept only if the entry held
  // still while they were copied.
  bool CopyPublishedResidual(int64_t layer, int32_t expert, std::span<std::byte> out) const;
  // Mailbox mode: brings the table to what the mailbox published, first publishing what was
  // posted when `apply_on_host` (only while no forward runs).
  void SyncWithMailbox(bool apply_on_host) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // The table as one update that maps every published READY entry onto a cleared table (the
  // recovery when an incremental sync is refused).
  void RebuildFromMailbox() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);

  SlotTable* const table_;
  const std::span<const std::byte> arena_;
  const release::ReleaseExpertDecoder* const decoder_;
  const SlotRuntimeOptions options_;

  absl::Mutex step_mu_;  // held for a whole step, and while applying
  mutable absl::Mutex pending_mu_;
  std::deque<nq::v1::SlotTableUpdate> pending_ ABSL_GUARDED_BY(pending_mu_);
  std::function<void(nq::v1::UnmapAck)> ack_sink_ ABSL_GUARDED_BY(pending_mu_);
  std::atomic<GroupRole> role_{GroupRole::kNone};
  std::vector<nq::v1::SlotTableUpdate> relayed_ ABSL_GUARDED_BY(pending_mu_);  // leader
  // After ResetForNewGroup until the next SnapshotForHello: the session's updates describe a
  // table this rank no longer holds.
  bool awaiting_hello_ ABSL_GUARDED_BY(pending_mu_) = false;
  std::atomic<uint32_t> current_step_{0};  // the step the last BeginStep began (logs)

  // Guarded by step_mu_ (read during a step, written while applying).
  std::map<std::pair<uint32_t, uint32_t>, uint64_t> slot_hash_;         // verify_slots
  // Mailbox mode: each (layer index, expert)'s published entry as the table last took it.
  std::vector<uint64_t> mailbox_seen_;
  // NoteLayerRan's rows for the running forward, by model layer: 1 where the expert ran at 4 bits.
  // The forward's thread only (NoteLayerRan, then count after the forward).
  std::map<int64_t, std::vector<uint8_t>> ran_rows_;
  std::atomic<uint32_t> loads_in_flight_{0};
  std::atomic<uint64_t> table_version_{0};  // +1 per applied update (SlotTables' generation)
  std::atomic<uint64_t> steps_{0};
  std::atomic<uint64_t> integrity_failures_{0};
  std::atomic<size_t> ready_count_{0};

  metrics::Counter& calls_4bit_;
  metrics::Counter& calls_2bit_;
  metrics::Counter& updates_applied_;
  metrics::Counter& updates_rejected_;
  metrics::Counter& integrity_counter_;
  metrics::Gauge& slots_ready_;
  metrics::Histogram& wait_seconds_;
};

}  // namespace nq::worker
