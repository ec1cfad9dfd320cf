// The worker's side of nq.v1.Streamer: registers the slot arena, keeps the session up, and
// hands slot-table updates to the SlotRuntime (which applies them between steps) and its
// unmap acknowledgements back to the streamer. It never blocks decode: when the streamer is absent or dies,
// the worker serves every expert at 2 bits and this client keeps retrying in the background.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.grpc.pb.h"
#include "services/common/internal_tls.h"
#include "services/common/metrics/registry.h"
#include "services/worker/slot_runtime.h"

namespace nq::worker {

struct StreamerClientOptions {
  std::string address;  // host:port of nq-streamer
  std::shared_ptr<const InternalTls> tls;  // mutual TLS to the streamer; null: plain text
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // The tensor-parallel group (RegisterWorkerRequest.tp_group); empty with world_size 1.
  std::string tp_group;
  std::string release_id;
  // The arena as the streamer must map it (shm name or CUDA IPC handle).
  nq::v1::RegisterWorkerRequest arena_request;
  // Deadline of each RegisterWorker call.
  std::chrono::milliseconds register_timeout{2000};
  // Reconnect backoff: doubles from min to max, with jitter.
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{2000};
};

class StreamerClient {
 public:
  // `on_connection_change(true)` runs when a session comes up, (false) when it goes down.
  StreamerClient(StreamerClientOptions options, SlotRuntime* runtime,
                 std::function<void(bool)> on_connection_change);
  ~StreamerClient();
  StreamerClient(const StreamerClient&) = delete;
  StreamerClient& operator=(const StreamerClient&) = delete;

  void Start();
  // Cancels the session and joins the background thread. Idempotent.
  void Stop();
  bool connected() const { return connected_.load(); }
  // Ends the current session and registers again at once, so the streamer adopts the slot
  // table as it is now (SlotRuntime::ResetForNewGroup cleared it). Any thread.
  void Resync();
  // Queues a routing report for the streamer without blocking the caller (the decode loop):
  // a writer thread sends it on the session. While no session is up, or when the queue is
  // full (the streamer fell behind), reports are dropped and counted.
  void EnqueueRoutingReport(nq::v1::RoutingReport report);
  // Queues a gate-lookahead hint (issue #21) the same way, capped at kMaxQueuedHints (the oldest
  // waiting hint is dropped for it). False, counted, when it is dropped: no session, or the
  // session's streamer does not take hints (RegisterWorkerResponse.accepts_lookahead_hints).
  bool EnqueueLookaheadHint(nq::v1::LookaheadHint hint);
  // Whether the current session's streamer takes lookahead hints.
  bool accepts_lookahead_hints() const { return accepts_hints_.load(); }
  // Hints waiting at most: a few tokens of a large model's layers. Older ones name tokens that
  // have finished.
  static constexpr size_t kMaxQueuedHints = 64;

 private:
  void Run();
  // One registration + session; returns when the session ends or fails.
  absl::Status RunSession();
  void SetConnected(bool connected);
  // Sleeps up to `duration`, returning early (false) when Stop() is called.
  bool SleepUnlessStopped(std::chrono::milliseconds duration);

  const StreamerClientOptions options_;
  SlotRuntime* const runtime_;
  const std::function<void(bool)> on_connection_change_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<nq::v1::Streamer::Stub> stub_;
  std::atomic<bool> connected_{false};
  std::string streamer_instance_id_;

  // Messages waiting for the session's writer thread: routing reports (dropped when the
  // queue is full) and unmap acknowledgements (never dropped while the session is up).
  absl::Mutex report_mu_;
  std::deque<nq::v1::WorkerMessage> outbox_ ABSL_GUARDED_BY(report_mu_);
  size_t queued_reports_ ABSL_GUARDED_BY(report_mu_) = 0;
  size_t queued_hints_ ABSL_GUARDED_BY(report_mu_) = 0;
  std::atomic<bool> accepts_hints_{false};
  bool writer_stop_ ABSL_GUARDED_BY(report_mu_) = false;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool resync_ ABSL_GUARDED_BY(mu_) = false;  // the session ends because Resync asked
  grpc::ClientContext* session_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread thread_;

  metrics::Gauge& connected_gauge_;
  metrics::Counter& registrations_;
  metrics::Counter& failures_;
  metrics::Counter& reports_sent_;
  metrics::Counter& reports_dropped_;
  metrics::Counter& hints_sent_;
  metrics::Counter& hints_dropped_;
};

}  // namespace nq::worker
