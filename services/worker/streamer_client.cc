#include "services/worker/streamer_client.h"

#include <random>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
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
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

}  // namespace

StreamerClient::StreamerClient(StreamerClientOptions options, SlotTable* table,
                               std::function<void(bool)> on_connection_change)
    : options_(std::move(options)),
      table_(table),
      on_connection_change_(std::move(on_connection_change)),
      channel_(MakeChannel(options_.address)),
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
      updates_applied_(metrics::Registry::Default()
                           .Counter("nq_worker_slot_updates_applied_total",
                                    "Slot-table updates applied at a step boundary")
                           .Get()),
      updates_rejected_(metrics::Registry::Default()
                            .Counter("nq_worker_slot_updates_rejected_total",
                                     "Slot-table updates rejected as protocol violations")
                            .Get()),
      reports_sent_(metrics::Registry::Default()
                        .Counter("nq_worker_routing_reports_sent_total", "Routing reports sent to nq-streamer")
                        .Get()),
      reports_dropped_(metrics::Registry::Default()
                           .Counter("nq_worker_routing_reports_dropped_total",
                                    "Routing reports dropped (no streamer session, or the queue was full)")
                           .Get()) {}

void StreamerClient::EnqueueRoutingReport(nq::v1::RoutingReport report) {
  // Bounded: a streamer that falls behind loses the oldest reports, never blocks decode.
  constexpr size_t kMaxQueuedReports = 64;
  if (!connected()) {
    reports_dropped_.Increment();
    return;
  }
  absl::MutexLock lock(&report_mu_);
  if (reports_.size() >= kMaxQueuedReports) {
    reports_.pop_front();
    reports_dropped_.Increment();
  }
  reports_.push_back(std::move(report));
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
  request.set_release_id(options_.release_id);
  *request.mutable_geometry() = table_->geometry().ToProto();

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
    spdlog::info("streamer restarted (instance {} -> {}); resyncing {} READY slots",
                 streamer_instance_id_, response.streamer_instance_id(), table_->ReadySlots().size());
  }
  streamer_instance_id_ = response.streamer_instance_id();

  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::CancelledError("stopping");
    session_context_ = &context;
  }
  auto clear_context = [this] {
    absl::MutexLock lock(&mu_);
    session_context_ = nullptr;
  };
  std::unique_ptr<grpc::ClientReaderWriter<nq::v1::WorkerMessage, nq::v1::StreamerMessage>> stream =
      stub_->Session(&context);
  nq::v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id(response.worker_id());
  for (nq::v1::SlotEntry& entry : table_->ReadySlots()) {
    *hello.mutable_hello()->add_ready_slots() = std::move(entry);
  }
  hello.mutable_hello()->set_applied_generation(table_->applied_generation());
  if (!stream->Write(hello)) {
    clear_context();
    return Annotate(FromGrpcStatus(stream->Finish()), "session hello");
  }
  spdlog::info("registered with streamer {} as {} (rank {}/{}, arena {} bytes)", options_.address,
               response.worker_id(), options_.rank, options_.world_size,
               table_->geometry().ArenaBytes());
  SetConnected(true);

  // The writer thread sends queued routing reports; writes are serialised with the unmap
  // acknowledgements this thread sends.
  absl::Mutex write_mu;
  {
    absl::MutexLock lock(&report_mu_);
    writer_stop_ = false;
    reports_.clear();
  }
  std::thread writer([&] {
    while (true) {
      nq::v1::RoutingReport report;
      {
        absl::MutexLock lock(&report_mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(report_mu_) { return writer_stop_ || !reports_.empty(); };
        report_mu_.Await(absl::Condition(&ready));
        if (writer_stop_) return;
        report = std::move(reports_.front());
        reports_.pop_front();
      }
      nq::v1::WorkerMessage out;
      *out.mutable_routing() = std::move(report);
      absl::MutexLock lock(&write_mu);
      if (!stream->Write(out)) return;
      reports_sent_.Increment();
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
  uint64_t step = 0;
  while (stream->Read(&message)) {
    if (!message.has_update()) continue;
    // No decode loop runs between updates here: the worker is at a step boundary whenever
    // this thread holds an update, so it applies it at once.
    std::vector<nq::v1::SlotRef> unmapped;
    absl::Status applied = table_->ApplyAtStepBoundary(message.update(), &unmapped);
    if (!applied.ok()) {
      updates_rejected_.Increment();
      spdlog::error("rejected slot-table update generation {}: {}", message.update().generation(),
                    applied.ToString());
      continue;
    }
    updates_applied_.Increment();
    if (unmapped.empty()) continue;
    nq::v1::WorkerMessage ack;
    ack.mutable_unmap_ack()->set_generation(message.update().generation());
    ack.mutable_unmap_ack()->set_step(step);
    for (nq::v1::SlotRef& ref : unmapped) *ack.mutable_unmap_ack()->add_slots() = std::move(ref);
    absl::MutexLock lock(&write_mu);
    if (!stream->Write(ack)) break;
  }
  // The session is over (streamer gone or Stop): cancel so the writer's Write cannot hang.
  context.TryCancel();
  stop_writer();
  grpc::Status finished = stream->Finish();
  clear_context();
  if (finished.ok()) return absl::UnavailableError("streamer closed the session");
  return Annotate(FromGrpcStatus(finished), "session");
}

}  // namespace nq::worker
