#include "services/streamer/slot_loader.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "services/format/file_io.h"
#include "services/common/elapsed.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/streamer/routing_report.h"

namespace nq::streamer {
namespace {

// The thread sleeps until an event is queued or a read lands, both signalled through
// eventfds; this bound only caps what a lost wake-up (an eventfd error, logged) could cost.
// A worker sending malformed reports, or more than its loader reads, does so with every block:
// one log line per interval (with the count since the last one) says so without flooding the log.
constexpr std::chrono::seconds kReportLogInterval(10);
// The predictor state is written every this many refreshes (16 tokens each) besides at the
// session's end, so a streamer that crashes loses at most this much history.
constexpr uint64_t kStateSaveRefreshes = 256;

// Prepares the store's bounce buffers as copy sources for every member's arena (device arenas
// copy from page-locked memory) and returns those that could be for all of them; a buffer that
// cannot be pinned for one member is left out (and released for the others).
std::vector<unsigned> PrepareSources(const std::vector<std::shared_ptr<RegisteredWorker>>& members,
                                     const RecordStore& store, unsigned buffers) {
  std::vector<unsigned> prepared;
  for (unsigned b = 0; b < buffers; ++b) {
    size_t done = 0;
    for (; done < members.size(); ++done) {
      const RegisteredWorker& worker = *members[done];
      if (worker.remote()) continue;  // its node's streamer copies from its own buffers
      if (absl::Status s = worker.arena->PrepareSource(store.Buffer(b)); !s.ok()) {
        spdlog::warn("worker {}: bounce buffer {} not prepared, left out: {}", worker.worker_id, b, s.ToString());
        break;
      }
    }
    if (done == members.size()) {
      prepared.push_back(b);
      continue;
    }
    for (size_t m = 0; m < done; ++m) {
      if (!members[m]->remote()) members[m]->arena->ReleaseSource(store.Buffer(b));
    }
  }
  return prepared;
}


}  // namespace

absl::StatusOr<std::unique_ptr<SlotLoader>> SlotLoader::Create(std::shared_ptr<RegisteredWorker> worker,
                                                               const SlotLoaderOptions& options,
                                                               LoaderMetrics* metrics, Send send) {
  // A single worker loads its own rank's records, whatever its rank.
  return CreateForMembers({std::move(worker)}, options, metrics, std::move(send));
}

absl::StatusOr<std::unique_ptr<SlotLoader>> SlotLoader::CreateForGroup(
    std::vector<std::shared_ptr<RegisteredWorker>> members, const SlotLoaderOptions& options, LoaderMetrics* metrics,
    Send send) {
  if (members.empty()) return absl::FailedPreconditionError("a tensor-parallel group without ranks");
  // The loader sends its updates to rank 0's session, so rank 0 must be this streamer's.
  if (members[0] != nullptr && members[0]->remote()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor-parallel group ", members[0]->tp_group,
        ": rank 0 is served by another streamer; the streamer of rank 0's node decides for the group"));
  }
  const std::string geometry = members[0] != nullptr ? members[0]->geometry.ToProto().SerializeAsString() : "";
  for (size_t r = 0; r < members.size(); ++r) {
    if (members[r] == nullptr || members[r]->rank != r) {
      return absl::FailedPreconditionError(absl::StrCat("tensor-parallel group: rank ", r, " is missing"));
    }
    if (members[r]->geometry.ToProto().SerializeAsString() != geometry) {
      return absl::FailedPreconditionError(absl::StrCat("tensor-parallel group ", members[r]->tp_group, ": rank ", r,
                                                        "'s slot arena geometry differs from rank 0's"));
    }
    // Its ranks apply changes at the step rank 0 names; a mailbox would apply them at whatever
    // step each rank reaches first (the registry refuses one from a rank of such a group).
    if (members.size() > 1 && members[r]->mailbox != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("tensor-parallel group ", members[r]->tp_group, ": rank ", r,
                                                        " has a slot mailbox; a group's ranks take changes in updates"));
    }
  }
  return CreateForMembers(std::move(members), options, metrics, std::move(send));
}

absl::StatusOr<std::unique_ptr<SlotLoader>> SlotLoader::CreateForMembers(
    std::vector<std::shared_ptr<RegisteredWorker>> members, const SlotLoaderOptions& options, LoaderMetrics* metrics,
    Send send) {
  if (options.files == nullptr) return absl::InvalidArgumentError("slot loader: no record files");
  RecordStoreOptions store_options = options.store;
  // A group's load reads one record per rank at once.
  store_options.queue_depth = std::max<unsigned>(store_options.queue_depth, static_cast<unsigned>(members.size()));
  store_options.buffers = std::max(store_options.buffers, store_options.queue_depth);
  ASSIGN_OR_RETURN(std::unique_ptr<RecordStore> store, RecordStore::Create(options.files, store_options));
  ASSIGN_OR_RETURN(EventFd wake, EventFd::Create());
  const SlotGeometry& g = members[0]->geometry;
  const format::Manifest& manifest = store->release().manifest();
  if (g.experts_per_layer != manifest.experts_per_layer) {
    return absl::FailedPreconditionError(absl::StrCat("worker has ", g.experts_per_layer,
                                                      " experts per layer, the release ", manifest.experts_per_layer));
  }
  for (const std::shared_ptr<RegisteredWorker>& member : members) {
    if (member->remote()) continue;  // its records are its node's streamer's to check
    for (uint32_t layer : g.moe_layer_ids) {
      absl::StatusOr<uint64_t> rec_bytes = store->RecordBytes(member->rank, layer);
      if (!rec_bytes.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("the release has no records for rank ", member->rank, " layer ", layer));
      }
      if (*rec_bytes > g.rec_bytes) {
        return absl::FailedPreconditionError(absl::StrCat("layer ", layer, " records are ", *rec_bytes,
                                                          " bytes, the worker's slots ", g.rec_bytes));
      }
    }
  }
  SlotLoaderOptions loader_options = options;
  loader_options.store = store_options;
  return std::unique_ptr<SlotLoader>(new SlotLoader(std::move(members), std::move(store), std::move(wake),
                                                    loader_options, metrics, std::move(send)));
}

SlotLoader::SlotLoader(std::vector<std::shared_ptr<RegisteredWorker>> members, std::unique_ptr<RecordStore> store,
                       EventFd wake, const SlotLoaderOptions& options, LoaderMetrics* metrics, Send send)
    : members_(std::move(members)),
      worker_(members_[0]),
      store_(std::move(store)),
      read_depth_(options.store.queue_depth),
      wake_(std::move(wake)),
      options_(options),
      metrics_(metrics),
      send_(std::move(send)),
      allocator_(worker_->geometry),
      events_(options.max_queued_reports, &metrics->reports_dropped, LoaderEvents::kDefaultMaxHints,
              &metrics->hints_dropped),
      pacer_(ReadPacerOptions{.queue_depth = options_.store.queue_depth,
                              .max_budget = options_.predictor.read_budget,
                              .refresh_interval = options_.predictor.refresh_interval}),
      prepared_buffers_(
          PrepareSources(members_, *store_, std::max(options_.store.buffers, options_.store.queue_depth))),
      cache_(prepared_buffers_) {
  if (members_.size() == 1 && worker_->mailbox != nullptr) {
    poster_.emplace(worker_->mailbox.get(), &allocator_, metrics_);
  }
}

SlotLoader::~SlotLoader() {
  Stop();
  for (unsigned b : prepared_buffers_) {
    for (const std::shared_ptr<RegisteredWorker>& member : members_) {
      if (!member->remote()) member->arena->ReleaseSource(store_->Buffer(b));
    }
  }
}

absl::Status SlotLoader::Start(const nq::v1::SessionHello& hello) {
  const std::vector<nq::v1::SlotEntry> ready(hello.ready_slots().begin(), hello.ready_slots().end());
  RETURN_IF_ERROR(allocator_.Adopt(ready));
  // Generations continue above what the worker applied: it ignores anything older.
  next_generation_ = hello.applied_generation() + 1;
  const SlotGeometry& g = worker_->geometry;
  for (size_t li = 0; li < g.moe_layer_ids.size(); ++li) {
    const format::ManifestLayer* ml = store_->release().manifest().FindLayer(g.moe_layer_ids[li]);
    if (ml == nullptr) continue;
    const size_t fixed = std::min<size_t>(ml->fixed_4bit.size(), g.fixed_slots_per_layer);
    for (size_t i = 0; i < fixed; ++i) {
      queue_.push_back(
          Want{.layer = g.moe_layer_ids[li], .expert = ml->fixed_4bit[i], .fixed = true, .decided = Clock::now()});
    }
  }
  spdlog::info("worker {}: {} READY slots adopted, {} fixed-set loads queued, {} floating slots per layer, changes "
               "{}",
               worker_->worker_id, hello.ready_slots_size(), queue_.size(), allocator_.floating_slots(),
               poster_.has_value() ? "posted to its slot mailbox" : "sent in updates");
  if (allocator_.floating_slots() == 0) {
    spdlog::warn("worker {}: its arena has {} slots per layer for a fixed set of {}: NO floating slot, so only the "
                 "fixed set ever runs at 4 bits and the predictor places nothing (give the worker more "
                 "--slots_per_layer)",
                 worker_->worker_id, g.slots_per_layer, g.fixed_slots_per_layer);
  }
  thread_ = std::thread([this] { Run(); });
  return absl::OkStatus();
}

void SlotLoader::OnRouting(nq::v1::RoutingReport report) {
  {
    absl::MutexLock lock(&mu_);
    if (!events_.PushReport(std::move(report))) {
      stats_.reports_dropped = events_.dropped_reports();
      static LogRateLimiter dropped_log(kReportLogInterval);
      if (long n = dropped_log.Allow()) {
        spdlog::warn("worker {}: routing report dropped, {} wait for the loader ({} since last report)",
                     worker_->worker_id, events_.queued_reports(), n);
      }
      return;  // the loader has plenty to read already
    }
  }
  Wake();
}

void SlotLoader::OnLookahead(nq::v1::LookaheadHint hint) {
  {
    absl::MutexLock lock(&mu_);
    if (!events_.PushHint(std::move(hint))) {
      // Counted by the queue (nq_streamer_lookahead_hints_total{result="dropped"}); the hints
      // waiting already name later tokens than any we could still serve.
      stats_.hints_dropped = events_.dropped_hints();
      return;
    }
  }
  Wake();
}

void SlotLoader::OnUnmapAck(nq::v1::UnmapAck ack) {
  {
    absl::MutexLock lock(&mu_);
    events_.PushAck(std::move(ack));
  }
  Wake();
}

void SlotLoader::OnUnmapAck(uint32_t rank, nq::v1::UnmapAck ack) {
  {
    absl::MutexLock lock(&mu_);
    events_.PushRankAck(rank, std::move(ack));
  }
  Wake();
}

void SlotLoader::OnPeerLoaded(uint32_t rank, nq::v1::LoadResult result) {
  {
    absl::MutexLock lock(&mu_);
    events_.PushPeerResult(rank, std::move(result));
  }
  Wake();
}

void SlotLoader::Wake() {
  if (absl::Status s = wake_.Signal(); !s.ok()) {
    static LogRateLimiter wake_log(std::chrono::seconds(10));
    if (long n = wake_log.Allow()) {
      spdlog::error("worker {}: loader wake-up lost ({} since last report), it waits up to {} s: {}",
                    worker_->worker_id, n, absl::ToDoubleSeconds(options_.max_sleep), s.ToString());
    }
  }
}

void SlotLoader::Sleep() {
  const int fds[] = {wake_.fd(), store_->completion_fd()};
  // The worker publishes what it applied without waking us: poll while that matters.
  const absl::Duration timeout = poster_.has_value() && poster_->pending()
                                     ? std::min(options_.max_sleep, kMailboxPollInterval)
                                     : options_.max_sleep;
  absl::StatusOr<std::vector<bool>> readable = WaitReadable(fds, timeout);
  absl::Status cleared = readable.ok() ? wake_.Clear() : readable.status();
  if (!cleared.ok()) {
    static LogRateLimiter sleep_log(std::chrono::seconds(10));
    if (long n = sleep_log.Allow()) {
      spdlog::error("worker {}: loader wait failed ({} since last report): {}", worker_->worker_id, n,
                    cleared.ToString());
    }
    // Never spin on a persistent error.
    absl::SleepFor(absl::Milliseconds(10));
  }
  // The ring's signal is cleared by the next Reap (RecordStore::Poll), before it drains.
}

std::string SlotLoader::StatePath() const {
  if (options_.predictor_state_dir.empty()) return "";
  if (worker_->tp_group.empty()) {
    return absl::StrCat(options_.predictor_state_dir, "/predictor_rank", worker_->rank, ".state");
  }
  // One predictor per group: named by the group (its name made a plain file name).
  std::string group = worker_->tp_group;
  for (char& c : group) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '_';
  }
  return absl::StrCat(options_.predictor_state_dir, "/predictor_group", group, ".state");
}

void SlotLoader::SaveState() {
  const std::string path = StatePath();
  if (path.empty() || !predictor_.has_value()) return;
  const absl::Status written = format::WriteFileAtomic(path, predictor_->SaveState());
  if (!written.ok()) {
    static LogRateLimiter save_log(kReportLogInterval);
    if (long n = save_log.Allow()) {
      spdlog::warn("worker {}: saving predictor state: {} ({} since last report)", worker_->worker_id,
                   written.ToString(), n);
    }
  }
}

void SlotLoader::Stop() {
  std::lock_guard<std::mutex> stopping(stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  Wake();
  const bool was_running = thread_.joinable();
  if (thread_.joinable()) thread_.join();
  // The loader thread is gone: its predictor is ours to save.
  if (was_running) SaveState();
  metrics_->read_backlog_bytes.Increment(-published_backlog_);
  metrics_->read_queue_depth.Increment(-published_depth_);
  metrics_->unacked_generations.Increment(-published_unacked_);
  published_backlog_ = published_depth_ = published_unacked_ = 0;
}

SlotLoader::Stats SlotLoader::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void SlotLoader::Run() {
  while (true) {
    std::deque<Event> events;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
      events = events_.TakeAll();
    }
    // First, so the refreshes and Pump below may reuse the slots it frees.
    PollMailbox();
    for (const Event& event : events) {
      if (const auto* report = std::get_if<nq::v1::RoutingReport>(&event)) {
        HandleRouting(*report);
        continue;
      }
      if (const auto* hint = std::get_if<nq::v1::LookaheadHint>(&event)) {
        HandleHint(*hint);
        continue;
      }
      if (const auto* peer = std::get_if<LoaderEvents::PeerResult>(&event)) {
        nq::v1::SlotTableUpdate update;
        HandlePeerResult(peer->rank, peer->result, update);
        SendThenDeferred(std::move(update), /*always=*/false);
        continue;
      }
      const auto* ranked = std::get_if<LoaderEvents::RankAck>(&event);
      const uint32_t rank = ranked != nullptr ? ranked->rank : worker_->rank;
      const nq::v1::UnmapAck& ack = ranked != nullptr ? ranked->ack : std::get<nq::v1::UnmapAck>(event);
      if (poster_.has_value()) {
        // Its mailbox says what it applied; trusting an ack could free a slot the mailbox maps.
        static LogRateLimiter mailbox_ack_log(kReportLogInterval);
        if (long n = mailbox_ack_log.Allow()) {
          spdlog::warn("worker {}: unmap acknowledgement of generation {} from rank {}, which takes its changes "
                       "from its slot mailbox; ignored ({} since last report)",
                       worker_->worker_id, ack.generation(), rank, n);
        }
        continue;
      }
      HandleAck(rank, ack);
    }
    if (!session_gone_) {
      nq::v1::SlotTableUpdate update;
      Pump(update);
      SendThenDeferred(std::move(update), /*always=*/false);
    }
    Reap();
    FinishCutPlan();
    PublishGauges();
    // Events queued since the swap above signalled wake_ after queueing, and reads that
    // land after Reap's drain signal the ring's eventfd: neither is slept through.
    Sleep();
  }
  // Reads still in flight land in our own buffers; drain them so the ring is idle. Ask the
  // kernel to stop them first: a stalled drive must not hold up the session's end.
  for (const auto& [tag, read] : in_flight_) {
    if (!read.cancelled) (void)store_->Cancel(tag);
  }
  while (store_->outstanding() > 0) {
    if (!store_->Wait().ok()) break;
  }
}

absl::Status SlotLoader::EnsurePredictor(const nq::v1::RoutingReport& report) {
  if (predictor_.has_value()) return absl::OkStatus();
  // The layers the worker reports (the main model's MoE layers; the MTP layer never runs
  // during decode), in the report's order.
  ASSIGN_OR_RETURN(std::vector<uint32_t> layers, ReportLayers(report));
  PredictorOptions options = options_.predictor;
  options.num_layers = static_cast<uint32_t>(layers.size());
  options.experts_per_layer = worker_->geometry.experts_per_layer;
  options.floating_slots = allocator_.floating_slots();
  options.fixed.clear();
  options.static_ranking.clear();
  std::vector<size_t> indexes;
  for (uint32_t layer : layers) {
    ASSIGN_OR_RETURN(size_t li, worker_->geometry.LayerIndex(layer));
    indexes.push_back(li);
    const format::ManifestLayer* ml = store_->release().manifest().FindLayer(layer);
    std::vector<uint32_t> fixed;
    if (ml != nullptr) {
      const size_t n = std::min<size_t>(ml->fixed_4bit.size(), worker_->geometry.fixed_slots_per_layer);
      fixed.assign(ml->fixed_4bit.begin(), ml->fixed_4bit.begin() + static_cast<std::ptrdiff_t>(n));
    }
    options.fixed.push_back(std::move(fixed));
    options.static_ranking.push_back(ml != nullptr ? ml->ranking : std::vector<uint32_t>{});
  }
  options.top_k = static_cast<uint32_t>(report.layer_entries(0).experts_size());
  ASSIGN_OR_RETURN(Predictor predictor, Predictor::Create(std::move(options)));
  if (const std::string path = StatePath(); !path.empty()) {
    absl::StatusOr<std::string> bytes = format::ReadFileToString(path);
    if (bytes.ok()) {
      absl::Status restored = predictor.RestoreState(*bytes);
      if (restored.ok()) {
        spdlog::info("worker {}: predictor state restored from {} ({} tokens of history)", worker_->worker_id, path,
                     predictor.tokens_observed());
      } else {
        spdlog::warn("worker {}: predictor state {} not used, starting cold: {}", worker_->worker_id, path,
                     restored.ToString());
      }
    } else if (!absl::IsNotFound(bytes.status())) {
      spdlog::warn("worker {}: reading predictor state {}: {}", worker_->worker_id, path, bytes.status().ToString());
    }
  }
  predictor_.emplace(std::move(predictor));
  predictor_layers_ = std::move(layers);
  predictor_layer_index_ = std::move(indexes);
  return absl::OkStatus();
}

void SlotLoader::HandleRouting(const nq::v1::RoutingReport& report) {
  static LogRateLimiter refused_log(std::chrono::seconds(10));
  absl::StatusOr<ReportPlace> place = order_.Accept(report);
  if (!place.ok()) {
    metrics_->reports_refused.Increment();
    if (long n = refused_log.Allow()) {
      spdlog::warn("worker {}: routing report refused: {} ({} since last report)", worker_->worker_id,
                   place.status().ToString(), n);
    }
    return;
  }
  if (*place == ReportPlace::kFirst || *place == ReportPlace::kNewSequence) metrics_->sequences.Increment();
  latest_sequence_ = std::max(latest_sequence_, report.sequence_id());
  if (*place == ReportPlace::kAfterGap) metrics_->report_gaps.Increment();
  if (absl::Status s = EnsurePredictor(report); !s.ok()) {
    // Only this report is lost: the next well-formed one starts the predictor (a learned
    // model of another geometry refuses every report, each time saying why).
    return RefuseMalformed(s.ToString());
  }
  // Checked whole first: a report refused halfway would already have fed some tokens.
  if (absl::Status s = CheckReport(report, predictor_layers_, worker_->geometry.experts_per_layer); !s.ok()) {
    return RefuseMalformed(std::string(s.message()));
  }
  // A new request: per-request predictor state (jF's sequence signals) starts over.
  if (*place == ReportPlace::kFirst || *place == ReportPlace::kNewSequence) {
    predictor_->NewSequence();
    pacer_.OnNewSequence();
  }
  pacer_.OnTokens(report.num_tokens(), Clock::now());
  const size_t L = predictor_layers_.size();
  const size_t tokens = report.num_tokens();
  std::vector<uint32_t> experts;
  std::vector<float> weights;
  std::vector<float> norms;
  uint64_t calls_4bit = 0, calls_2bit = 0;
  for (size_t t = 0; t < tokens; ++t) {
    experts.clear();
    weights.clear();
    norms.clear();
    for (size_t l = 0; l < L; ++l) {
      const nq::v1::LayerRouting& entry = report.layer_entries(static_cast<int>(t * L + l));
      for (int j = 0; j < entry.experts_size(); ++j) {
        const uint32_t e = entry.experts(j);  // CheckReport: below experts_per_layer
        const std::optional<uint32_t> slot = allocator_.SlotOf(predictor_layer_index_[l], e);
        (slot && allocator_.state(predictor_layer_index_[l], *slot) == SlotState::kReady ? calls_4bit : calls_2bit)++;
        experts.push_back(e);
        weights.push_back(entry.weights(j));
      }
      // 0 (a worker that predates input norms) stays 0: the features take 1 there.
      norms.push_back(entry.input_sq_norm());
    }
    if (absl::Status s = predictor_->Observe(experts, weights, norms); !s.ok()) return RefuseMalformed(s.ToString());
    if (predictor_->RefreshDue()) Refresh();
  }
  metrics_->calls_4bit.Increment(static_cast<double>(calls_4bit));
  metrics_->calls_2bit.Increment(static_cast<double>(calls_2bit));
}

void SlotLoader::RefuseMalformed(const std::string& why) {
  metrics_->reports_refused.Increment();
  metrics_->reports_malformed.Increment();
  // Shared by every loader: a flood from any worker is one line per interval.
  static LogRateLimiter malformed_log(kReportLogInterval);
  if (long n = malformed_log.Allow()) {
    spdlog::warn("worker {}: malformed routing report dropped: {} ({} malformed since last report)",
                 worker_->worker_id, why, n);
  }
}

void SlotLoader::FinishCutPlan() {
  if (!plan_cut_ || session_gone_ || reads_done_or_loads_started_ == 0 || !queue_.empty() || !loads_.empty()) return;
  metrics_->refreshes_idle.Increment();
  Refresh();
}

void SlotLoader::Refresh() {
  // Resync the predictor's residency with the slots (a failed, dropped or cancelled load never
  // landed).
  for (size_t l = 0; l < predictor_layers_.size(); ++l) {
    std::vector<uint32_t> floating;
    for (uint32_t e : allocator_.FloatingExperts(predictor_layer_index_[l])) {
      if (!predictor_->IsFixed(static_cast<uint32_t>(l), e)) floating.push_back(e);
    }
    // Transiently F + 1 (a replacement landing in the staging slot): keep the predictor's view.
    if (floating.size() <= allocator_.floating_slots()) {
      (void)predictor_->SetResident(static_cast<uint32_t>(l), floating);
    }
  }
  if (options_.pace_reads) predictor_->set_read_budget(pacer_.Budget(LiveReads()));
  const auto started = Clock::now();
  const PredictorPlan& plan = predictor_->Refresh();
  metrics_->refresh_seconds.Observe(SecondsSince(started));
  plan_cut_ = plan.loads.size() < plan.wanted_loads;
  reads_done_or_loads_started_ = 0;
  plan_desired_.clear();
  for (size_t l = 0; l < predictor_layers_.size(); ++l) {
    const auto desired = plan.desired.begin() + static_cast<std::ptrdiff_t>(l * predictor_->options().floating_slots);
    plan_desired_[predictor_layer_index_[l]].insert(desired, desired + plan.desired_count[l]);
  }
  CancelUnwanted(plan);
  // The new plan replaces floating loads not yet issued: an expert no longer wanted is not read.
  // A load planned again keeps the time it was first decided (nq_streamer_load_latency_seconds).
  std::map<std::pair<uint32_t, uint32_t>, Clock::time_point> decided;
  std::deque<Want> queue;
  for (const Want& want : queue_) {
    // A hinted load serves the token running now: a refresh made from older tokens keeps it.
    if (want.fixed || want.hinted) {
      queue.push_back(want);
    } else {
      decided.emplace(std::make_pair(want.layer, want.expert), want.decided);
    }
  }
  const auto now = Clock::now();
  for (const PlannedLoad& load : plan.loads) {
    const uint32_t layer = predictor_layers_[load.layer];
    if (failed_.count({layer, load.expert}) != 0) continue;
    auto earlier = decided.find({layer, load.expert});
    queue.push_back(Want{.layer = layer,
                         .expert = load.expert,
                         .victim = load.victim,
                         .fixed = false,
                         .decided = earlier == decided.end() ? now : earlier->second});
  }
  queue_ = std::move(queue);
  uint64_t refreshes = 0;
  {
    absl::MutexLock lock(&mu_);
    refreshes = ++stats_.refreshes;
  }
  if (refreshes % kStateSaveRefreshes == 0) SaveState();
  // The plan's loads start now (cache hits land at once), not after the rest of the report.
  // Every refresh ends with an update (possibly without changes) announcing the loads it
  // queued: a request's first tokens may wait for them, and a worker knows its report was
  // acted on.
  nq::v1::SlotTableUpdate update;
  if (!session_gone_) Pump(update);
  SendThenDeferred(std::move(update), /*always=*/true);
}

void SlotLoader::CancelUnwanted(const PredictorPlan& plan) {
  const uint32_t floating = predictor_->options().floating_slots;
  uint64_t cancelled = 0;
  for (auto it = loads_.begin(); it != loads_.end();) {
    GroupLoad& load = it->second;
    const auto layer = std::find(predictor_layers_.begin(), predictor_layers_.end(), load.want.layer);
    if (load.want.fixed || load.want.hinted || layer == predictor_layers_.end()) {
      ++it;
      continue;
    }
    const size_t l = static_cast<size_t>(layer - predictor_layers_.begin());
    const auto desired = plan.desired.begin() + static_cast<std::ptrdiff_t>(l * floating);
    if (std::find(desired, desired + plan.desired_count[l], load.want.expert) != desired + plan.desired_count[l]) {
      ++it;
      continue;  // still wanted
    }
    // Every rank's outstanding read of it: the reads land in their bounce buffers, never in the
    // slot, and are never announced (Reap only returns their buffers).
    size_t stopped = 0;
    for (auto& [tag, read] : in_flight_) {
      if (read.load != it->first || read.cancelled) continue;
      absl::StatusOr<CancelOutcome> outcome = store_->Cancel(tag);
      if (!outcome.ok()) {
        // The store and the loader disagree on what is outstanding: leave the read to land.
        spdlog::critical("worker {}: cancelling rank {}'s read of layer {} expert {}: {}", worker_->worker_id,
                         read.rank, load.want.layer, load.want.expert, outcome.status().ToString());
        continue;
      }
      read.cancelled = true;
      ++stopped;
      (*outcome == CancelOutcome::kDequeued ? metrics_->reads_cancelled_queued : metrics_->reads_cancelled_in_flight)
          .Increment();
      ++cancelled;
    }
    if (stopped == load.outstanding) {
      // Nothing of it will land: the slot is FREE for other loads now.
      (void)allocator_.Release(load.layer_index, load.slot);
      it = loads_.erase(it);
    } else {
      // A read the store would not cancel, or a remote rank's order, is still out: the load is
      // never announced, and its slot is freed once they are in (a remote streamer may be
      // writing it until it answers).
      load.outstanding -= stopped;
      load.cancelled = true;
      ++it;
    }
  }
  if (cancelled > 0) {
    absl::MutexLock lock(&mu_);
    stats_.reads_cancelled += cancelled;
  }
}

void SlotLoader::PollMailbox() {
  if (!poster_.has_value()) return;
  for (const nq::v1::UnmapAck& ack : poster_->Poll()) HandleAck(worker_->rank, ack);
}

void SlotLoader::HandleAck(uint32_t rank, const nq::v1::UnmapAck& ack) {
  if (Member(rank) == nullptr) {
    spdlog::warn("worker {}: unmap acknowledgement from rank {}, not a member; ignored", worker_->worker_id, rank);
    return;
  }
  if (auto sent = unacked_unmaps_.find(ack.generation()); sent != unacked_unmaps_.end()) {
    sent->second.acked.insert(rank);
    if (sent->second.acked.size() >= members_.size()) {  // the last rank's: the group's lag
      metrics_->unmap_ack_latency.Observe(SecondsSince(sent->second.sent));
      unacked_unmaps_.erase(sent);
    }
  }
  for (const nq::v1::SlotRef& ref : ack.slots()) {
    absl::StatusOr<size_t> li = worker_->geometry.LayerIndex(ref.layer());
    absl::Status s = li.status();
    if (li.ok() && allocator_.state(*li, ref.slot()) != SlotState::kUnmapping) {
      s = absl::FailedPreconditionError(absl::StrCat("layer ", ref.layer(), " slot ", ref.slot(), " is not unmapping"));
    } else if (li.ok()) {
      // The slot is reused only once no rank maps it (DESIGN.md section 4).
      std::set<uint32_t>& acked = unmap_acked_[{*li, ref.slot()}];
      acked.insert(rank);
      if (acked.size() < members_.size()) continue;
      unmap_acked_.erase({*li, ref.slot()});
      s = allocator_.Acknowledge(*li, ref.slot());
    }
    if (!s.ok()) {
      spdlog::warn("worker {}: unexpected unmap acknowledgement from rank {}: {}", worker_->worker_id, rank,
                   s.ToString());
    }
  }
}

void SlotLoader::HandlePeerResult(uint32_t rank, const nq::v1::LoadResult& result,
                                  nq::v1::SlotTableUpdate& update) {
  auto load = loads_.find(result.load_id());
  if (load == loads_.end() || load->second.remote_pending.erase(rank) == 0) {
    spdlog::warn("worker {}: rank {} answered load {}, which it has no order of; ignored", worker_->worker_id, rank,
                 result.load_id());
    return;
  }
  GroupLoad& group_load = load->second;
  ++reads_done_or_loads_started_;
  if (!result.ok()) {
    group_load.failed = true;
    metrics_->read_errors.WithLabels({"peer"}).Increment();
    static LogRateLimiter peer_failure_log(std::chrono::seconds(10));
    if (long n = peer_failure_log.Allow()) {
      spdlog::error("worker {}: rank {}'s streamer could not load layer {} expert {}, the expert stays at 2 bits on "
                    "every rank: {} ({} failures since last report)",
                    worker_->worker_id, rank, group_load.want.layer, group_load.want.expert, result.error(), n);
    }
  }
  if (--group_load.outstanding > 0) return;
  if (!session_gone_) Finish(group_load, update);
  loads_.erase(load);
}

void SlotLoader::SendThenDeferred(nq::v1::SlotTableUpdate update, bool always) {
  if (always || update.changes_size() > 0) SendUpdate(std::move(update));
  if ((!unmap_deferred_ && deferred_victims_.empty()) || session_gone_) return;
  // The unmaps ReadyInUpdate held back: their READYs went in the update just sent.
  nq::v1::SlotTableUpdate next;
  const SlotGeometry& g = worker_->geometry;
  for (const auto& [layer_index, expert] : std::exchange(deferred_victims_, {})) {
    std::optional<uint32_t> slot = allocator_.SlotOf(layer_index, expert);
    if (!slot || *slot < g.fixed_slots_per_layer || allocator_.state(layer_index, *slot) != SlotState::kReady) continue;
    (void)allocator_.MarkUnmapping(layer_index, *slot);
    nq::v1::SlotChange* unmap = next.add_changes();
    unmap->set_kind(nq::v1::SlotChange::KIND_UNMAP);
    unmap->set_layer(g.moe_layer_ids[layer_index]);
    unmap->set_slot(*slot);
    metrics_->unmaps.Increment();
  }
  unmap_deferred_ = false;
  Pump(next);
  // A load of this Pump may defer an unmap again (a cache hit landing at once): left to the next
  // pass, which every landed read or acknowledgement brings.
  if (next.changes_size() > 0) SendUpdate(std::move(next));
}

bool SlotLoader::SendUpdate(nq::v1::SlotTableUpdate update) {
  if (session_gone_) return false;
  const uint64_t generation = next_generation_++;
  update.set_generation(generation);
  update.set_loads_in_flight(static_cast<uint32_t>(queue_.size() + loads_.size()));
  const bool unmaps = std::any_of(update.changes().begin(), update.changes().end(), [](const nq::v1::SlotChange& c) {
    return c.kind() == nq::v1::SlotChange::KIND_UNMAP;
  });
  if (poster_.has_value()) {
    // Posted before the update goes, so the worker that wakes on it finds them.
    poster_->Post(generation, update);
    update.clear_changes();
  }
  nq::v1::StreamerMessage message;
  *message.mutable_update() = std::move(update);
  if (!send_(message)) {
    session_gone_ = true;  // the session thread notices too and stops us
    return false;
  }
  if (unmaps) unacked_unmaps_.emplace(generation, SentUnmap{.sent = Clock::now(), .acked = {}});
  absl::MutexLock lock(&mu_);
  ++stats_.updates_sent;
  return true;
}

RegisteredWorker* SlotLoader::Member(uint32_t rank) const {
  for (const std::shared_ptr<RegisteredWorker>& member : members_) {
    if (member->rank == rank) return member.get();
  }
  return nullptr;
}

size_t SlotLoader::LiveReads() const {
  size_t n = 0;
  for (const auto& [tag, read] : in_flight_) n += read.cancelled ? 0 : 1;
  return n;
}

uint64_t SlotLoader::BacklogBytes() const {
  // A queued load reads one record per member this streamer serves.
  const size_t local = static_cast<size_t>(
      std::count_if(members_.begin(), members_.end(), [](const auto& member) { return !member->remote(); }));
  return (queue_.size() * local + LiveReads()) * worker_->geometry.rec_bytes;
}

void SlotLoader::PublishGauges() {
  const double backlog = static_cast<double>(BacklogBytes());
  const double depth = static_cast<double>(in_flight_.size());
  const double unacked = static_cast<double>(unacked_unmaps_.size());
  metrics_->read_backlog_bytes.Increment(backlog - published_backlog_);
  metrics_->read_queue_depth.Increment(depth - published_depth_);
  metrics_->unacked_generations.Increment(unacked - published_unacked_);
  published_backlog_ = backlog;
  published_depth_ = depth;
  published_unacked_ = unacked;
  absl::MutexLock lock(&mu_);
  stats_.cached_records = cache_.records();
}

}  // namespace nq::streamer
