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
// One thread per loader owns its record store (an io_uring ring and bounce buffers over the
// process's shared RecordFiles), allocator and predictor; the session thread only queues
// reports and acks (a bounded queue, loader_events.h: reports past max_queued_reports are
// dropped and counted). The thread sleeps in poll(2) on two eventfds, its event queue's and the
// ring's completion signal, so it wakes as soon as a report, an ack or a read arrives and
// never polls. The loader writes only to the session stream (its `send`).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.pb.h"
#include "services/common/metrics/registry.h"
#include "services/streamer/event_fd.h"
#include "services/streamer/loader_events.h"
#include "services/streamer/predictor.h"
#include "services/streamer/record_store.h"
#include "services/streamer/report_order.h"
#include "services/streamer/slot_allocator.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

// The streamer's section-8 metrics, shared by every loader (created once, so /metrics shows
// them before the first worker connects).
struct LoaderMetrics {
  explicit LoaderMetrics(metrics::Registry& registry);
  metrics::Gauge& read_backlog_bytes;
  metrics::Gauge& read_queue_depth;
  metrics::Counter& read_bytes;
  metrics::Histogram& read_latency;
  metrics::Counter& loads_ready;
  metrics::Counter& loads_failed;
  metrics::Counter& unmaps;
  metrics::Histogram& refresh_seconds;
  metrics::Counter& calls_4bit;
  metrics::Counter& calls_2bit;
  metrics::Counter& reports_refused;
  metrics::Counter& reports_malformed;
  metrics::Counter& reports_dropped;
  metrics::Counter& report_gaps;
  metrics::Counter& sequences;
};

struct SlotLoaderOptions {
  // The release directory, then mirrors holding identical copies on other drives.
  std::vector<std::string> record_dirs;
  // Those directories' files, opened once per process and shared by every session, so
  // each layer file is hashed once per process. StreamerService opens them from
  // record_dirs at its first session when they are not given.
  std::shared_ptr<const RecordFiles> files;
  // Each session's own reader: queue depth, bounce buffers, hash checking.
  RecordStoreOptions store;
  // Tuning (half-lives, weights, hysteresis, read budget); layers, experts, floating slots
  // and fixed sets are filled in from the worker's geometry and the manifest.
  PredictorOptions predictor;
  // Routing reports waiting for the loader thread; more are dropped and counted
  // (nq_streamer_routing_reports_dropped_total, loader_events.h). A report is a few KB to a
  // few hundred KB (tokens x layers x top-k); 4096 keeps a loader busy with reads from dropping
  // the reports of a normal burst (a prefill reports every token) and still bounds the backlog.
  size_t max_queued_reports = 4096;
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
  ~SlotLoader();
  SlotLoader(const SlotLoader&) = delete;
  SlotLoader& operator=(const SlotLoader&) = delete;

  // Adopts the worker's READY slots, then loads the fixed sets and follows the predictor.
  // INVALID_ARGUMENT when the hello's slots contradict the geometry (nothing starts).
  absl::Status Start(const nq::v1::SessionHello& hello);
  void OnRouting(nq::v1::RoutingReport report);
  void OnUnmapAck(nq::v1::UnmapAck ack);
  // Joins the thread; reads in flight are reaped and dropped. Idempotent.
  void Stop();

  // Counters for tests and logs.
  struct Stats {
    uint64_t loads_ready = 0;
    uint64_t loads_failed = 0;
    uint64_t updates_sent = 0;
    uint64_t refreshes = 0;
    uint64_t reports_dropped = 0;  // the event queue was full (max_queued_reports)
  };
  Stats stats() const;

 private:
  struct Want {
    uint32_t layer = 0;
    uint32_t expert = 0;
    uint32_t victim = PlannedLoad::kNoVictim;
    bool fixed = false;
  };
  struct Read {
    size_t layer_index = 0;
    uint32_t slot = 0;
    Want want;
    unsigned buffer = 0;
    uint64_t bytes = 0;
  };
  using Event = LoaderEvents::Event;

  SlotLoader(std::shared_ptr<RegisteredWorker> worker, std::unique_ptr<RecordStore> store, EventFd wake,
             const SlotLoaderOptions& options, LoaderMetrics* metrics, Send send);
  // Wakes the loader thread (an event was queued, or Stop).
  void Wake();
  // Sleeps until an event is queued or a read lands.
  void Sleep();
  void Run();
  void HandleRouting(const nq::v1::RoutingReport& report);
  // Counts a malformed report (refused and malformed) and logs it, rate-limited.
  void RefuseMalformed(const std::string& why);
  void HandleAck(const nq::v1::UnmapAck& ack);
  absl::Status EnsurePredictor(const nq::v1::RoutingReport& report);
  void Refresh();
  void Pump();
  void Reap();
  // Sends `update` with the next generation; false when the session is gone.
  bool SendUpdate(nq::v1::SlotTableUpdate update);
  uint64_t BacklogBytes() const;
  void PublishGauges();

  const std::shared_ptr<RegisteredWorker> worker_;
  const std::unique_ptr<RecordStore> store_;
  const EventFd wake_;  // signalled after every queued event and by Stop
  const SlotLoaderOptions options_;
  LoaderMetrics* const metrics_;
  const Send send_;
  SlotAllocator allocator_;

  // Session thread -> loader thread.
  mutable absl::Mutex mu_;
  LoaderEvents events_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;

  // Loader thread only.
  std::optional<PredictorV0> predictor_;
  ReportOrder order_;  // the session's reports in order (sequence_id, first_token)
  std::vector<uint32_t> predictor_layers_;  // model layer ids the worker reports, in order
  std::vector<size_t> predictor_layer_index_;  // their index in the geometry
  std::deque<Want> queue_;             // loads not yet submitted, in priority order
  std::map<uint64_t, Read> in_flight_;  // by read tag
  std::vector<unsigned> free_buffers_;
  std::vector<unsigned> prepared_buffers_;  // PrepareSource'd, released at destruction
  std::set<std::pair<uint32_t, uint32_t>> failed_;  // (layer, expert) whose record failed
  uint64_t next_tag_ = 1;
  uint64_t next_generation_ = 1;
  bool session_gone_ = false;
  // This loader's contribution to the shared gauges, so several loaders add up.
  double published_backlog_ = 0;
  double published_depth_ = 0;
};

}  // namespace nq::streamer
