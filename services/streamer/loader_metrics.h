// The streamer's metrics (DESIGN.md section 8) that its slot loaders update: one set per
// process, shared by every worker session's loader (gauges are sums of the loaders' parts).
#pragma once

#include "services/common/metrics/registry.h"

namespace nq::streamer {

// The streamer's section-8 metrics, shared by every loader (created once, so /metrics shows
// them before the first worker connects).
struct LoaderMetrics {
  explicit LoaderMetrics(metrics::Registry& registry);
  metrics::Gauge& read_backlog_bytes;
  metrics::Gauge& read_queue_depth;
  metrics::Counter& read_bytes;
  metrics::Histogram& read_latency;
  metrics::Histogram& load_latency;
  metrics::Counter& cache_hits;
  metrics::Counter& cache_misses;
  metrics::Counter& reads_cancelled_queued;
  metrics::Counter& reads_cancelled_in_flight;
  metrics::Gauge& unacked_generations;
  metrics::Histogram& unmap_ack_latency;
  metrics::Counter& loads_ready;
  metrics::Counter& loads_failed;
  // Failed record reads by reason: io_error, short_read, hash, checksum, submit
  // (RecordCompletion::failure).
  metrics::CounterFamily& read_errors;
  // Reads of a second or more (kSlowReadSeconds), and the injected slow reads among all reads.
  metrics::Counter& slow_reads;
  metrics::Counter& slow_reads_injected;
  metrics::Counter& unmaps;
  // Slot mailboxes (mailbox_poster.h): post to the first poll that sees it applied, per post; and
  // posts by kind.
  metrics::Histogram& mailbox_lag;
  metrics::Counter& mailbox_posts_ready;
  metrics::Counter& mailbox_posts_unmap;
  metrics::Histogram& refresh_seconds;
  // Refreshes the loader made on its own to finish a plan the read budget cut short
  // (SlotLoader::FinishCutPlan).
  metrics::Counter& refreshes_idle;
  metrics::Counter& calls_4bit;
  metrics::Counter& calls_2bit;
  metrics::Counter& reports_refused;
  metrics::Counter& reports_malformed;
  metrics::Counter& reports_dropped;
  metrics::Counter& report_gaps;
  metrics::Counter& sequences;
  // Gate lookahead (issue #21, SlotLoader::HandleHint): hints by what became of them (accepted,
  // refused: malformed or stale, dropped: the loader's hint queue was full), and the loads they
  // caused by stage (queued: not resident, a load was queued ahead of the predictor's; ready:
  // announced READY; unplaced: no room without evicting an expert the same token's hints named).
  metrics::Counter& hints_accepted;
  metrics::Counter& hints_refused;
  metrics::Counter& hints_dropped;
  metrics::Counter& hint_loads_queued;
  metrics::Counter& hint_loads_ready;
  metrics::Counter& hint_loads_unplaced;
  // A hinted load's hint (taken by the loader thread) to its copy into the slot being complete:
  // what must fit in D layers' time for it to land in time.
  metrics::Histogram& hint_load_latency;
  // Groups spanning nodes (docs/tp_streamers.md). On the deciding streamer: remote ranks linked
  // now. On an applying one: the decider's orders this streamer answered, by result.
  metrics::Gauge& peer_links_active;
  metrics::Counter& peer_orders_ok;
  metrics::Counter& peer_orders_failed;
};

}  // namespace nq::streamer
