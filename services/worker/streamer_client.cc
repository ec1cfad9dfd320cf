#include "services/worker/streamer_client.h"

#include <random>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/status_grpc.h"
#include "services/common/internal_tls.h"
#include "services/common/status_macros.h"
#include "services/worker/session_outbox.h"

namespace nq::worker {
namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const InternalTls* tls) {
  grpc::ChannelArguments args;
  // The session is a long-lived stream without a deadline; keepalive pings are what notice
  // a streamer that vanished without closing its socket.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Reconnect quickly once the streamer is back: our own loop handles the backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1'000);
  return InternalChannel(address, tls, args);
}

}  // namespace

StreamerClient::StreamerClient(StreamerClientOptions options, SlotRuntime* runtime,
                               std::function<void(bool)> on_connection_change)
    : options_(std::move(options)),
      runtime_(runtime),
      on_connection_change_(std::move(on_connection_change)),
      channel_(MakeChannel(options_.address, options_.tls.get())),
      stub_(nq::v1::Streamer::NewStub(channel_)),
      connected_gauge_(metrics::Registry::Default()
                           .Gauge("nq_worker_streamer_connected",
                                  "Whether the session with nq-streamer is up (1) or not (0: "
                                  "every expert then runs at 2 bits)")
                           .Get()),
      registrations_(metrics::Registry::Default()
                         .Counter("nq_worker_streamer_registrations_total",
                                  "Successful registrations with nq-streamer")
                         .Get()),
      failures_(metrics::Registry::Default()
                    .Counter("nq_worker_streamer_connect_failures_total",
                             "Failed registrations or broken sessions with nq-streamer")
                    .Get()),
      reports_sent_(metrics::Registry::Default()
                        .Counter("nq_worker_routing_reports_sent_total", "Routing reports sent to nq-streamer")
                        .Get()),
      reports_dropped_(metrics::Registry::Default()
                           .Counter("nq_worker_routing_reports_dropped_total",
                                    "Routing reports dropped (no streamer session, or the queue was full)")
                           .Get()),
      hints_sent_(metrics::Registry::Default()
                      .Counter("nq_worker_lookahead_hints_total",
                               "Gate lookahead hints (--lookahead_layers) by result: sent to nq-streamer, or "
                               "dropped (no session, a streamer that does not take hints, or the queue of "
                               "kMaxQueuedHints was full: the oldest waiting hint goes)",
                               {"result"})
                      .WithLabels({"sent"})),
      hints_dropped_(metrics::Registry::Default()
                         .Counter("nq_worker_lookahead_hints_total", "", {"result"})
                         .WithLabels({"dropped"})) {}

void StreamerClient::EnqueueRoutingReport(nq::v1::RoutingReport report) {
  // Bounded: a streamer that falls behind loses the oldest reports, never blocks decode.
  constexpr size_t kMaxQueuedReports = 64;
  if (!connected()) {
    reports_dropped_.Increment();
    return;
  }
  nq::v1::WorkerMessage message;
  *message.mutable_routing() = std::move(report);
  absl::MutexLock lock(&report_mu_);
  const size_t dropped = PushDroppingOldest(outbox_, queued_reports_, kMaxQueuedReports, std::move(message),
                                            [](const nq::v1::WorkerMessage& m) { return m.has_routing(); });
  if (dropped > 0) reports_dropped_.Increment(static_cast<double>(dropped));
}

bool StreamerClient::EnqueueLookaheadHint(nq::v1::LookaheadHint hint) {
  if (!connected() || !accepts_hints_.load()) {
    hints_dropped_.Increment();
    return false;
  }
  nq::v1::WorkerMessage message;
  *message.mutable_lookahead() = std::move(hint);
  absl::MutexLock lock(&report_mu_);
  const size_t dropped = PushDroppingOldest(outbox_, queued_hints_, kMaxQueuedHints, std::move(message),
                                            [](const nq::v1::WorkerMessage& m) { return m.has_lookahead(); });
  if (dropped > 0) hints_dropped_.Increment(static_cast<double>(dropped));
  return true;
}

StreamerClient::~StreamerClient() { Stop(); }

void StreamerClient::Start() { thread_ = std::thread([this] { Run(); }); }

void StreamerClient::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (session_context_ != nullptr) session_context_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void StreamerClient::Resync() {
  absl::MutexLock lock(&mu_);
  resync_ = true;
  if (session_context_ != nullptr) session_context_->TryCancel();
}

bool StreamerClient::SleepUnlessStopped(std::chrono::milliseconds duration) {
  absl::MutexLock lock(&mu_);
  auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
  mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::FromChrono(duration));
  return !stopping_;
}

void StreamerClient::SetConnected(bool connected) {
  if (connected_.exchange(connected) == connected) return;
  connected_gauge_.Set(connected ? 1 : 0);
  if (on_connection_change_) on_connection_change_(connected);
}

void StreamerClient::Run() {
  std::mt19937_64 rng(std::random_device{}());
  std::chrono::milliseconds backoff = options_.min_backoff;
  LogRateLimiter limiter(std::chrono::seconds(10));
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
    }
    const auto started = std::chrono::steady_clock::now();
    absl::Status status = RunSession();
    SetConnected(false);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      if (std::exchange(resync_, false)) {
        spdlog::info("registering with streamer {} again: this rank's slot table was reset", options_.address);
        continue;
      }
    }
    failures_.Increment();
    if (long calls = limiter.Allow()) {
      spdlog::warn("streamer {} unavailable, serving every expert at 2 bits and retrying: {} "
                   "({} attempts since last report)",
                   options_.address, status.ToString(), calls);
    }
    // A session that lived a while resets the backoff: the next failure is a fresh outage.
    if (std::chrono::steady_clock::now() - started > std::chrono::seconds(5)) {
      backoff = options_.min_backoff;
    }
    std::uniform_int_distribution<long> jitter(0, backoff.count() / 2);
    if (!SleepUnlessStopped(backoff + std::chrono::milliseconds(jitter(rng)))) break;
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::Status StreamerClient::RunSession() {
  nq::v1::RegisterWorkerRequest request = options_.arena_request;
  request.set_rank(options_.rank);
  request.set_world_size(options_.world_size);
  request.set_tp_group(options_.tp_group);
  request.set_release_id(options_.release_id);
  *request.mutable_geometry() = runtime_->table().geometry().ToProto();

  nq::v1::RegisterWorkerResponse response;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options_.register_timeout);
    context.set_wait_for_ready(false);
    grpc::Status status = stub_->RegisterWorker(&context, request, &response);
    if (!status.ok()) return Annotate(FromGrpcStatus(status), "RegisterWorker");
  }
  registrations_.Increment();
  if (!streamer_instance_id_.empty() && streamer_instance_id_ != response.streamer_instance_id()) {
    spdlog::info("streamer restarted (instance {} -> {}); resyncing from this worker's slot table",
                 streamer_instance_id_, response.streamer_instance_id());
  }
  streamer_instance_id_ = response.streamer_instance_id();
  accepts_hints_.store(response.accepts_lookahead_hints());

  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::CancelledError("stopping");
    session_context_ = &context;
    // The hello below snapshots the table as it is now: an earlier Resync is served by it.
    resync_ = false;
  }
  auto clear_context = [this] {
    absl::MutexLock lock(&mu_);
    session_context_ = nullptr;
  };
  std::unique_ptr<grpc::ClientReaderWriter<nq::v1::WorkerMessage, nq::v1::StreamerMessage>> stream =
      stub_->Session(&context);
  nq::v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id(response.worker_id());
  // Taken between steps, with the old session's unapplied updates dropped: the streamer
  // adopts exactly what this worker maps.
  auto [ready_slots, applied_generation] = runtime_->SnapshotForHello();
  for (nq::v1::SlotEntry& entry : ready_slots) *hello.mutable_hello()->add_ready_slots() = std::move(entry);
  hello.mutable_hello()->set_applied_generation(applied_generation);
  if (!stream->Write(hello)) {
    clear_context();
    return Annotate(FromGrpcStatus(stream->Finish()), "session hello");
  }
  spdlog::info("registered with streamer {} as {} (rank {}/{}, arena {} bytes)", options_.address,
               response.worker_id(), options_.rank, options_.world_size,
               runtime_->table().geometry().ArenaBytes());
  SetConnected(true);

  // The writer thread sends queued routing reports and unmap acknowledgements.
  {
    absl::MutexLock lock(&report_mu_);
    writer_stop_ = false;
    outbox_.clear();
    queued_reports_ = 0;
    queued_hints_ = 0;
  }
  runtime_->SetAckSink([this](nq::v1::UnmapAck ack) {
    nq::v1::WorkerMessage message;
    *message.mutable_unmap_ack() = std::move(ack);
    absl::MutexLock lock(&report_mu_);
    outbox_.push_back(std::move(message));
  });
  std::thread writer([&] {
    while (true) {
      nq::v1::WorkerMessage out;
      {
        absl::MutexLock lock(&report_mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(report_mu_) { return writer_stop_ || !outbox_.empty(); };
        report_mu_.Await(absl::Condition(&ready));
        if (writer_stop_) return;
        out = std::move(outbox_.front());
        outbox_.pop_front();
        if (out.has_routing()) --queued_reports_;
        if (out.has_lookahead()) --queued_hints_;
      }
      if (!stream->Write(out)) return;
      if (out.has_routing()) reports_sent_.Increment();
      if (out.has_lookahead()) hints_sent_.Increment();
    }
  });
  auto stop_writer = [&] {
    {
      absl::MutexLock lock(&report_mu_);
      writer_stop_ = true;
    }
    writer.join();
  };

  nq::v1::StreamerMessage message;
  while (stream->Read(&message)) {
    // Applied at the next step boundary (or now, between requests).
    if (message.has_update()) runtime_->Post(std::move(*message.mutable_update()));
  }
  // Acknowledgements of this session are meaningless to the next one (it resyncs).
  runtime_->SetAckSink(nullptr);
  // Read returned false, so the call is over (the streamer ended it, the connection broke, or
  // Stop cancelled it) and a pending Write fails at once. No TryCancel here: it would turn the
  // streamer's own status (why it ended the session) into CANCELLED.
  stop_writer();
  grpc::Status finished = stream->Finish();
  clear_context();
  if (finished.ok()) return absl::UnavailableError("streamer closed the session");
  return Annotate(FromGrpcStatus(finished), "session");
}

}  // namespace nq::worker
