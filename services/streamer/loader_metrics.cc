#include "services/streamer/loader_metrics.h"

#include "services/common/metrics/buckets.h"

namespace nq::streamer {

LoaderMetrics::LoaderMetrics(metrics::Registry& registry)
    : read_backlog_bytes(registry.Gauge("nq_streamer_read_backlog_bytes",
                                        "Bytes of record reads wanted but not yet landed in a slot").Get()),
      read_queue_depth(registry.Gauge("nq_streamer_read_queue_depth", "Record reads in flight").Get()),
      read_bytes(registry.Counter("nq_streamer_read_bytes_total", "Bytes of records read").Get()),
      read_latency(registry.Histogram("nq_streamer_read_latency_seconds",
                                      "Record read latency, issue to landing: from the read's submission to the "
                                      "io_uring ring to its completion being reaped (one observation per read "
                                      "that landed whole)",
                                      metrics::ExponentialBuckets(25e-6, 2, 16)).Get()),
      load_latency(registry.Histogram("nq_streamer_load_latency_seconds",
                                      "Slot load latency: from the decision to load an expert (session start or "
                                      "predictor refresh) to its record's copy into the slot being complete",
                                      metrics::ExponentialBuckets(1e-4, 2, 20)).Get()),
      cache_hits(registry.Counter("nq_streamer_record_cache_total",
                                  "Slot loads by where the record came from: hit, a bounce buffer that still held "
                                  "it from a recent read (no disk read); miss, a read from disk",
                                  {"result"}).WithLabels({"hit"})),
      cache_misses(registry.Counter("nq_streamer_record_cache_total", "", {"result"}).WithLabels({"miss"})),
      reads_cancelled_queued(registry.Counter("nq_streamer_reads_cancelled_total",
                                              "Record reads cancelled because a predictor refresh no longer wanted "
                                              "the expert, by stage: queued (never reached the disk) or in_flight "
                                              "(the kernel was asked to stop it; if it lands it is discarded)",
                                              {"stage"}).WithLabels({"queued"})),
      reads_cancelled_in_flight(
          registry.Counter("nq_streamer_reads_cancelled_total", "", {"stage"}).WithLabels({"in_flight"})),
      unacked_generations(registry.Gauge("nq_streamer_unacked_generations",
                                         "Slot-table updates that unmap slots, sent to workers and not yet "
                                         "acknowledged by every rank of the group (the slots wait in UNMAPPING; "
                                         "only unmaps are acknowledged; a worker with a slot mailbox acknowledges "
                                         "by publishing the unmaps applied there)")
                              .Get()),
      unmap_ack_latency(registry.Histogram("nq_streamer_unmap_ack_latency_seconds",
                                           "Worker apply lag: from sending an update that unmaps slots to the "
                                           "acknowledgement of it by the group's last rank (slot mailbox: to the "
                                           "poll that sees its every unmap applied)",
                                           metrics::ExponentialBuckets(1e-4, 2, 20)).Get()),
      loads_ready(registry.Counter("nq_streamer_slot_loads_total",
                                   "Slot loads finished, by result (ready: announced READY; failed: the "
                                   "record failed its hash or read, never announced)",
                                   {"result"}).WithLabels({"ready"})),
      loads_failed(registry.Counter("nq_streamer_slot_loads_total", "", {"result"}).WithLabels({"failed"})),
      read_errors(registry.Counter("nq_streamer_read_errors_total",
                                   "Record reads that failed, by reason (io_error: the drive returned an error; "
                                   "short_read: fewer bytes than the record; hash: its file failed its sha256; "
                                   "checksum: the record failed its own sha256 in the index; "
                                   "submit: the read could not be queued; peer: another node's streamer could not load a "
                                   "remote rank's record); each leaves its expert at 2 bits",
                                   {"reason"})),
      slow_reads(registry.Counter("nq_streamer_slow_reads_total",
                                  "Record reads that took a second or more from issue to landing (a stalled "
                                  "drive; injected ones included); their experts ran at 2 bits meanwhile").Get()),
      slow_reads_injected(registry.Counter("nq_streamer_read_faults_injected_total",
                                           "Faults injected into record reads by --inject_read_faults, by kind "
                                           "(slow; EIO and short reads show in nq_streamer_read_errors_total)",
                                           {"kind"}).WithLabels({"slow"})),
      unmaps(registry.Counter("nq_streamer_slot_unmaps_total", "Slots the streamer asked a worker to unmap").Get()),
      mailbox_lag(registry.Histogram("nq_streamer_mailbox_lag_seconds",
                                     "Slot mailbox apply lag: from posting a READY or UNMAP to a worker's slot "
                                     "mailbox to the loader's first poll that sees the worker applied it (one "
                                     "observation per post; the poll runs at least every millisecond while "
                                     "posts wait)",
                                     metrics::ExponentialBuckets(1e-4, 2, 20)).Get()),
      mailbox_posts_ready(registry.Counter("nq_streamer_mailbox_posts_total",
                                           "Slot-table changes posted to workers' slot mailboxes instead of sent "
                                           "in updates, by kind (ready, unmap)",
                                           {"kind"}).WithLabels({"ready"})),
      mailbox_posts_unmap(registry.Counter("nq_streamer_mailbox_posts_total", "", {"kind"}).WithLabels({"unmap"})),
      refresh_seconds(registry.Histogram("nq_streamer_predictor_refresh_seconds",
                                         "Time of one predictor refresh (score, plan)",
                                         metrics::ExponentialBuckets(1e-6, 2, 22)).Get()),
      refreshes_idle(registry.Counter("nq_streamer_predictor_idle_refreshes_total",
                                      "Predictor refreshes the loader made without new tokens: the last plan was "
                                      "cut by the read budget and its loads were done, so it plans the rest "
                                      "(decode had stopped or its reports came in a burst)").Get()),
      calls_4bit(registry.Counter("nq_streamer_expert_calls_total",
                                  "Routed expert calls reported by workers, by the precision the streamer's "
                                  "table gives them (4: READY in a slot)",
                                  {"bits"}).WithLabels({"4"})),
      calls_2bit(registry.Counter("nq_streamer_expert_calls_total", "", {"bits"}).WithLabels({"2"})),
      reports_refused(registry.Counter("nq_streamer_routing_reports_refused_total",
                                       "Routing reports not fed to the predictor: out of order (an older "
                                       "sequence, or tokens already reported) or malformed").Get()),
      reports_malformed(registry.Counter("nq_streamer_routing_reports_malformed_total",
                                         "Routing reports refused as malformed (layers, experts, weights or token "
                                         "counts that contradict the worker's geometry); also counted in "
                                         "nq_streamer_routing_reports_refused_total").Get()),
      reports_dropped(registry.Counter("nq_streamer_routing_reports_dropped_total",
                                       "Routing reports dropped unread because the loader's queue was full "
                                       "(SlotLoaderOptions.max_queued_reports)").Get()),
      report_gaps(registry.Counter("nq_streamer_routing_report_gaps_total",
                                   "Routing reports that followed missing tokens of their sequence (blocks "
                                   "the worker dropped)").Get()),
      sequences(registry.Counter("nq_streamer_routing_sequences_total",
                                 "Worker sequences whose routing reached a predictor").Get()),
      hints_accepted(registry.Counter("nq_streamer_lookahead_hints_total",
                                      "Gate lookahead hints from workers (issue #21), by result: accepted; refused "
                                      "(a layer without slots, an expert outside the layer, duplicate experts, a "
                                      "sequence older than the session's latest); dropped (the loader's hint queue "
                                      "was full)",
                                      {"result"}).WithLabels({"accepted"})),
      hints_refused(registry.Counter("nq_streamer_lookahead_hints_total", "", {"result"}).WithLabels({"refused"})),
      hints_dropped(registry.Counter("nq_streamer_lookahead_hints_total", "", {"result"}).WithLabels({"dropped"})),
      hint_loads_queued(registry.Counter("nq_streamer_lookahead_loads_total",
                                         "Slot loads caused by lookahead hints, by stage: queued (a hinted expert "
                                         "was not resident or loading; its load goes ahead of the predictor's); "
                                         "ready (announced READY); unplaced (dropped: the layer holds its F "
                                         "floating experts and the same token's hints named every READY one)",
                                         {"stage"}).WithLabels({"queued"})),
      hint_loads_ready(registry.Counter("nq_streamer_lookahead_loads_total", "", {"stage"}).WithLabels({"ready"})),
      hint_loads_unplaced(
          registry.Counter("nq_streamer_lookahead_loads_total", "", {"stage"}).WithLabels({"unplaced"})),
      hint_load_latency(registry.Histogram("nq_streamer_lookahead_load_latency_seconds",
                                           "Hinted slot loads: from the loader taking the lookahead hint to the "
                                           "record's copy into the slot being complete (the worker applies it at its "
                                           "next MoE layer, or step)",
                                           metrics::ExponentialBuckets(25e-6, 2, 18)).Get()),
      peer_links_active(registry.Gauge("nq_streamer_peer_links_active",
                                       "Ranks of this streamer's tensor-parallel groups served by another node's "
                                       "streamer, linked now (StreamerPeer.RankLink)").Get()),
      peer_orders_ok(registry.Counter("nq_streamer_peer_orders_total",
                                      "Load orders of another node's deciding streamer this streamer answered, by "
                                      "result (ok: the record is in the rank's slot)",
                                      {"result"}).WithLabels({"ok"})),
      peer_orders_failed(registry.Counter("nq_streamer_peer_orders_total", "", {"result"}).WithLabels({"failed"})) {}

}  // namespace nq::streamer
