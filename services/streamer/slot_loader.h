// Drives one worker's slot arena (DESIGN.md sections 4 and 7): the worker's routing reports
// feed predictor v0; every refresh its plan becomes record reads (io_uring, O_DIRECT, into
// registered bounce buffers) that are copied into FREE slots and announced READY in a
// generation-numbered SlotTableUpdate. A replacement's victim is unmapped in the same update
// that makes the replacement READY (lazy eviction); its slot is reused only after the
// worker's UnmapAck. The fixed 4-bit set is loaded first, when the session opens.
//
// A read that fails (the layer file fails its hash, a short read) frees its slot, is never
// announced, is counted in nq_streamer_slot_loads_total{result="failed"} and logged, and that
// expert is not retried for the session.
//
// The bounce buffers double as an LRU cache of recent records (bounce_cache.h): a wanted
// expert whose record still sits in a buffer is copied into its slot without a disk read
// (nq_streamer_record_cache_total{result="hit"}). Only a record that landed whole from a file
// whose hash matched is kept. At most read_queue_depth reads are outstanding; the other
// buffers keep their records until a read needs one.
//
// A refresh that no longer wants an expert whose read is outstanding cancels it
// (RecordStore::Cancel; nq_streamer_reads_cancelled_total): its slot is FREE at once (the read
// lands in the bounce buffer, never in the slot) and it is never announced, even when the
// kernel could not stop the read and it lands all the same.
//
// A tensor-parallel group (group_sessions.h) has one loader for all its ranks: one predictor fed by
// rank 0's reports, one allocator (every rank's slot s of a layer holds the same expert), and
// every load reads each rank's own record of (layer, expert) into that rank's slot. The load is
// announced READY only when every rank's bytes landed; if any rank's read or copy fails, nobody
// hears of it (the slot is FREE again and the expert marked failed), so ranks never disagree.
// An unmapped slot is reused only when every rank acknowledged the unmap. Updates go to rank
// 0's session only: rank 0 relays them to the other ranks in the step command of the step at
// which every rank applies them (services/worker/step_command.h).
//
// A group whose ranks span nodes (docs/tp_streamers.md) has its loader on rank 0's node; a rank
// served by another node's streamer is a remote member (RegisteredWorker::order_load): its part of
// a load is an order sent to that streamer, done when its result comes back (OnPeerLoaded), and it
// counts like a local read (a failed result fails the load for every rank). A remote order cannot
// be cancelled: a load a refresh no longer wants keeps its slot until every remote answer is in,
// and is then freed, not counted as failed. Remote ranks' unmap acknowledgements arrive forwarded.
//
// A single worker that registered a slot mailbox (worker_registry.h) takes its changes there,
// inside its decode steps (DESIGN.md section 4): every update's UNMAPs, then its READYs, are
// posted to the mailbox (mailbox_poster.h) and the update goes without changes, its generation
// and loads in flight the worker's doorbell. An unmapped slot is reused once the mailbox shows
// the unmap applied; UnmapAcks from such a worker are unexpected, logged and ignored.
//
// Gate lookahead (issue #21, slot_loader_lookahead.cc): a worker's hint names the experts a layer
// will likely route to for the token running now. The named experts that are neither READY nor
// loading are queued ahead of every planned load, through the same Pump/StartLoad/Finish path
// (one owner per slot, LOADING only is written, a victim leaves when its replacement lands or
// once its unmap is acknowledged). Past F floating experts a hinted load names a victim: a READY
// floating expert that no hint of the same token named for that layer, preferring one the last
// refresh did not want; when there is none the hinted load is dropped (unplaced). A refresh
// neither cancels nor drops a hinted load. A hint whose experts are all resident queues nothing.
//
// One thread per loader owns its record store (an io_uring ring and bounce buffers over the
// process's shared RecordFiles), allocator and predictor; the session thread only queues
// reports and acks (a bounded queue, loader_events.h: reports past max_queued_reports are
// dropped and counted). The thread sleeps in poll(2) on two eventfds, its event queue's and the
// ring's completion signal, so it wakes as soon as a report, an ack or a read arrives; it polls
// only a slot mailbox with posts not yet applied (kMailboxPollInterval). The loader writes only
// to the session stream (its `send`) and its worker's mailbox.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nq/v1/streamer.pb.h"
#include "services/streamer/bounce_cache.h"
#include "services/streamer/event_fd.h"
#include "services/streamer/loader_events.h"
#include "services/streamer/loader_metrics.h"
#include "services/streamer/mailbox_poster.h"
#include "services/streamer/predictor.h"
#include "services/streamer/read_pacer.h"
#include "services/streamer/record_store.h"
#include "services/streamer/report_order.h"
#include "services/streamer/slot_allocator.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

struct SlotLoaderOptions {
  // The release directory, then mirrors holding identical copies on other drives.
  std::vector<std::string> record_dirs;
  // Those directories' files, opened once per process and shared by every session (their
  // manifest and indexes hashed once, at the open). StreamerService opens them from
  // record_dirs at its first session when they are not given.
  std::shared_ptr<const RecordFiles> files;
  // Each session's own reader: queue depth (reads outstanding at once), bounce buffers (at
  // least the queue depth; the rest keep recent records for the cache), hash checking.
  RecordStoreOptions store;
  // Tuning (half-lives, weights, hysteresis, read budget); layers, experts, floating slots
  // and fixed sets are filled in from the worker's geometry and the manifest.
  // predictor.learned: the jF model (--predictor FILE), or null for v0.
  PredictorOptions predictor;
  // Where each rank's predictor state is kept (predictor_rank<r>.state): restored when the
  // rank's session starts its predictor, written every kStateSaveRefreshes refreshes and when
  // the session ends, so a restarted streamer does not start cold. Empty: not kept.
  std::string predictor_state_dir;
  // Paces each refresh's loads by the measured read throughput and decode pace (read_pacer.h),
  // at most predictor.read_budget; false: always predictor.read_budget.
  bool pace_reads = true;
  // Routing reports waiting for the loader thread; more are dropped and counted
  // (nq_streamer_routing_reports_dropped_total, loader_events.h). A report is a few KB to a
  // few hundred KB (tokens x layers x top-k); 4096 keeps a loader busy with reads from dropping
  // the reports of a normal burst (a prefill reports every token) and still bounds the backlog.
  size_t max_queued_reports = 4096;
  // The longest the loader thread sleeps with no event: a safety net should a wake-up be lost
  // (every event and landed read signals it). Tests raise it to show a path needs no net.
  absl::Duration max_sleep = absl::Seconds(1);
};

class SlotLoader {
 public:
  // Writes one message on the worker's session; false once the stream is gone.
  using Send = std::function<bool(const nq::v1::StreamerMessage&)>;

  // A record store of its own over `options.files` for `worker`'s rank. INVALID_ARGUMENT
  // without options.files; FAILED_PRECONDITION when the worker's geometry cannot hold the
  // release's records (slot smaller than a record, experts or layers the release lacks);
  // the errors of RecordStore::Create and eventfd(2).
  static absl::StatusOr<std::unique_ptr<SlotLoader>> Create(std::shared_ptr<RegisteredWorker> worker,
                                                            const SlotLoaderOptions& options,
                                                            LoaderMetrics* metrics, Send send);
  // The loader of a tensor-parallel group: `members[r]` is rank r (all of one group, with one
  // geometry); `send` is rank 0's session. FAILED_PRECONDITION when a member is missing, out
  // of place, its geometry differs from rank 0's, or a group of several has a slot mailbox; the
  // errors of the single-worker Create.
  static absl::StatusOr<std::unique_ptr<SlotLoader>> CreateForGroup(
      std::vector<std::shared_ptr<RegisteredWorker>> members, const SlotLoaderOptions& options,
      LoaderMetrics* metrics, Send send);
  ~SlotLoader();
  SlotLoader(const SlotLoader&) = delete;
  SlotLoader& operator=(const SlotLoader&) = delete;

  // Adopts the worker's READY slots, then loads the fixed sets and follows the predictor.
  // INVALID_ARGUMENT when the hello's slots contradict the geometry (nothing starts).
  absl::Status Start(const nq::v1::SessionHello& hello);
  void OnRouting(nq::v1::RoutingReport report);
  // A lookahead hint (queued for the loader thread; dropped and counted when hints fill the queue).
  void OnLookahead(nq::v1::LookaheadHint hint);
  void OnUnmapAck(nq::v1::UnmapAck ack);
  // A group member's acknowledgement (rank < the group's size; others are logged and ignored).
  void OnUnmapAck(uint32_t rank, nq::v1::UnmapAck ack);
  // A remote member's answer to an order (an unknown load or rank is logged and ignored).
  void OnPeerLoaded(uint32_t rank, nq::v1::LoadResult result);
  // Joins the thread; reads in flight are reaped and dropped. Idempotent, and safe to call from
  // several threads at once: each returns once the thread is gone.
  void Stop();

  // Counters for tests and logs.
  struct Stats {
    uint64_t loads_ready = 0;
    uint64_t loads_failed = 0;
    uint64_t updates_sent = 0;
    uint64_t refreshes = 0;
    uint64_t reports_dropped = 0;  // the event queue was full (max_queued_reports)
    uint64_t disk_reads = 0;       // reads handed to the record store (cache misses)
    uint64_t cache_hits = 0;       // loads copied from a bounce buffer, no disk read
    uint64_t reads_cancelled = 0;  // outstanding reads a refresh no longer wanted
    uint64_t cancelled_reads_landed = 0;  // of those, reads the kernel finished anyway
    uint64_t cached_records = 0;   // bounce buffers holding a record now
    uint64_t hints_accepted = 0;
    uint64_t hints_refused = 0;       // malformed or stale (HandleHint)
    uint64_t hints_dropped = 0;       // the event queue held max hints already
    uint64_t hint_loads_queued = 0;   // hinted experts not resident: a load queued
    uint64_t hint_loads_ready = 0;    // of those, announced READY
    uint64_t hint_loads_unplaced = 0; // F floating experts held, all named by the token's hints
  };
  Stats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Want {
    uint32_t layer = 0;
    uint32_t expert = 0;
    uint32_t victim = PlannedLoad::kNoVictim;
    bool fixed = false;
    Clock::time_point decided;  // when the session start or a refresh first asked for it
    bool hinted = false;        // queued by a lookahead hint: refreshes keep it, never cancel it
    Clock::time_point hinted_at{};  // when the loader took that hint
  };
  // One rank's read of a load.
  struct Read {
    uint64_t load = 0;  // the GroupLoad it belongs to
    uint32_t rank = 0;
    unsigned buffer = 0;
    // Cancelled by a refresh: its slot is already FREE; its completion only returns the buffer.
    bool cancelled = false;
  };
  // A slot being filled with (layer, expert)'s records, one per member rank; READY once every
  // rank's bytes are in that rank's arena.
  struct GroupLoad {
    size_t layer_index = 0;
    uint32_t slot = 0;
    Want want;
    size_t outstanding = 0;  // local reads not yet landed plus remote orders not yet answered
    std::set<uint32_t> remote_pending = {};  // remote ranks whose answer is still out
    bool failed = false;     // a rank's read or copy failed: never announced
    // A refresh no longer wants it, but a read or order it could not stop is still out: its slot
    // is freed once they are in, and the expert is not marked failed.
    bool cancelled = false;
  };
  using Event = LoaderEvents::Event;

  static absl::StatusOr<std::unique_ptr<SlotLoader>> CreateForMembers(
      std::vector<std::shared_ptr<RegisteredWorker>> members, const SlotLoaderOptions& options,
      LoaderMetrics* metrics, Send send);
  SlotLoader(std::vector<std::shared_ptr<RegisteredWorker>> members, std::unique_ptr<RecordStore> store,
             EventFd wake, const SlotLoaderOptions& options, LoaderMetrics* metrics, Send send);
  // Wakes the loader thread (an event was queued, or Stop).
  void Wake();
  // Sleeps until an event is queued or a read lands, or kMailboxPollInterval while mailbox posts
  // wait to be applied.
  void Sleep();
  // Mailbox mode: acknowledges, as the worker's UnmapAcks would, every generation whose unmaps
  // the worker applied.
  void PollMailbox();
  void Run();
  void HandleRouting(const nq::v1::RoutingReport& report);
  // Counts a malformed report (refused and malformed) and logs it, rate-limited.
  void RefuseMalformed(const std::string& why);
  void HandleAck(uint32_t rank, const nq::v1::UnmapAck& ack);
  // slot_loader_lookahead.cc: checks a hint (CheckHint), then queues loads for its experts that
  // are not resident, ahead of the queue.
  void HandleHint(const nq::v1::LookaheadHint& hint);
  // INVALID_ARGUMENT for a layer the geometry has no slots for, no experts or more than the
  // layer has, an expert id out of range or named twice, weights of another length;
  // FAILED_PRECONDITION for a sequence older than the latest this session reported or hinted.
  absl::Status CheckHint(const nq::v1::LookaheadHint& hint) const;
  // A READY floating expert of the layer to make room for a hinted load: not in `keep` (what
  // the token's hints named for the layer) nor already some queued load's victim; one the last
  // refresh did not want first. kNoVictim when there is none.
  uint32_t HintVictim(size_t layer_index, const std::set<uint32_t>& keep) const;
  void HandlePeerResult(uint32_t rank, const nq::v1::LoadResult& result, nq::v1::SlotTableUpdate& update);
  absl::Status EnsurePredictor(const nq::v1::RoutingReport& report);
  void Refresh();
  // A plan the read budget cut short (read_pacer.h: no more reads than land before the next
  // refresh, due a refresh interval of tokens later) leaves the rest to that refresh. When
  // decode stops (the last request ended, or reports arrived in one burst) no report brings it,
  // and the desired experts would wait at 2 bits for the next request. So once the plan's loads
  // are done the loader refreshes on its own. Only after a read landed or a load started since
  // the last refresh (a cut plan may have no loads at all while reads it cancelled are still
  // out): each such refresh follows progress, so they stop once the plan is whole or nothing
  // more loads.
  void FinishCutPlan();
  // The predictor state file of this worker's rank (empty without predictor_state_dir).
  std::string StatePath() const;
  // Writes the predictor's state (tmp + rename); failures are logged, never fatal.
  void SaveState();
  // Cancels the outstanding floating reads of experts outside the plan's desired sets.
  void CancelUnwanted(const PredictorPlan& plan);
  // Serves queued loads: from the bounce cache, or by issuing reads while the queue depth and
  // a buffer allow; READY changes and eager unmaps go into `update`.
  void Pump(nq::v1::SlotTableUpdate& update);
  // Copies rank `rank`'s `record` into its arena's LOADING slot; false (logged) when it could not.
  bool CopyIntoSlot(uint32_t rank, size_t layer_index, uint32_t slot, const Want& want,
                    std::span<const std::byte> record);
  // Every rank's read of `load` is done: READY (and the victim's unmap, lazy eviction) into
  // `update`; or, when one failed, the slot FREE again and the expert marked failed.
  void Finish(const GroupLoad& load, nq::v1::SlotTableUpdate& update);
  // Starts `want` into reserved `slot`: cache hits copied now, reads issued for the rest.
  void StartLoad(size_t layer_index, uint32_t slot, const Want& want, nq::v1::SlotTableUpdate& update);
  void Reap();
  // The member serving `rank` (a single worker: its own rank), or null.
  RegisteredWorker* Member(uint32_t rank) const;
  // Reads issued and not cancelled (what the worker may still see land).
  size_t LiveReads() const;
  // Sends `update` with the next generation (in mailbox mode its changes posted to the mailbox
  // first and left out); false when the session is gone.
  bool SendUpdate(nq::v1::SlotTableUpdate update);
  // Sends `update` (when it has changes, or `always`), then, in another update, the unmaps that
  // could not go in it: a victim made READY in the same update (ReadyInUpdate in slot_loader.cc)
  // leaves in the next one, and the load that waited for it starts.
  void SendThenDeferred(nq::v1::SlotTableUpdate update, bool always);
  uint64_t BacklogBytes() const;
  void PublishGauges();

  // By rank: one worker, or every rank of a group. worker_ is members_[0] (the geometry, the
  // session, the name in logs).
  const std::vector<std::shared_ptr<RegisteredWorker>> members_;
  const std::shared_ptr<RegisteredWorker> worker_;
  const std::unique_ptr<RecordStore> store_;
  // Reads outstanding at once: the store's queue depth, at least one per member so a group's
  // load can always be issued whole.
  const size_t read_depth_;
  const EventFd wake_;  // signalled after every queued event and by Stop
  const SlotLoaderOptions options_;
  LoaderMetrics* const metrics_;
  const Send send_;
  SlotAllocator allocator_;
  // Set for a single worker with a slot mailbox (mailbox mode); over allocator_.
  std::optional<MailboxPoster> poster_;

  // Session thread -> loader thread.
  mutable absl::Mutex mu_;
  LoaderEvents events_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
  std::mutex stop_mu_;  // one Stop at a time (the join, the state save, the gauges)

  // Loader thread only.
  std::optional<Predictor> predictor_;
  ReadPacer pacer_;
  ReportOrder order_;  // the session's reports in order (sequence_id, first_token)
  std::vector<uint32_t> predictor_layers_;  // model layer ids the worker reports, in order
  std::vector<size_t> predictor_layer_index_;  // their index in the geometry
  std::deque<Want> queue_;             // loads not yet submitted, in priority order
  std::map<uint64_t, Read> in_flight_;  // by read tag, cancelled ones until they complete
  std::map<uint64_t, GroupLoad> loads_;  // by load id, while reads of it are outstanding
  uint64_t next_load_ = 1;
  // Ranks that acknowledged the unmap of each UNMAPPING (layer index, slot) so far.
  std::map<std::pair<size_t, uint32_t>, std::set<uint32_t>> unmap_acked_;
  size_t landing_ = 0;  // reads Reap has taken out of in_flight_ and not yet copied
  bool plan_cut_ = false;  // the last refresh's plan had fewer loads than it wanted (FinishCutPlan)
  uint64_t reads_done_or_loads_started_ = 0;  // since the last refresh (FinishCutPlan)
  std::vector<unsigned> prepared_buffers_;  // PrepareSource'd, released at destruction
  BounceCache cache_;                       // over prepared_buffers_
  // Generations of sent updates that unmap slots, not yet acknowledged by every member, when
  // they went and which ranks have acknowledged: the workers' apply lag the streamer can see
  // (DESIGN.md section 4: a slot is reused only after every rank acknowledges the update that
  // unmapped it).
  struct SentUnmap {
    Clock::time_point sent;
    std::set<uint32_t> acked;  // ranks
  };
  std::map<uint64_t, SentUnmap> unacked_unmaps_;
  std::set<std::pair<uint32_t, uint32_t>> failed_;  // (layer, expert) whose record failed
  // Lookahead: the newest sequence the session reported or hinted (older hints are refused), the
  // token its latest hint was for, and per layer index the experts that token's hints named
  // (never victims of its hinted loads); the last refresh's desired floating experts per layer
  // index (victims come from outside them first).
  uint64_t latest_sequence_ = 0;
  std::pair<uint64_t, uint64_t> hint_token_{0, 0};
  std::map<size_t, std::set<uint32_t>> token_hinted_;
  std::map<size_t, std::set<uint32_t>> plan_desired_;
  uint64_t next_tag_ = 1;
  uint64_t next_generation_ = 1;
  bool session_gone_ = false;
  // Unmaps held back from an update that made their slot READY (SendThenDeferred): an eager one
  // (Pump kept its load queued), and lazy victims by (layer index, expert).
  bool unmap_deferred_ = false;
  std::vector<std::pair<size_t, uint32_t>> deferred_victims_;
  // This loader's contribution to the shared gauges, so several loaders add up.
  double published_backlog_ = 0;
  double published_depth_ = 0;
  double published_unacked_ = 0;
};

}  // namespace nq::streamer
