#include "services/streamer/peer_order_runner.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

// The thread sleeps until an order arrives or a read lands (both signal an eventfd); this only
// bounds what a lost wake-up could cost.
constexpr absl::Duration kMaxSleep = absl::Seconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<PeerOrderRunner>> PeerOrderRunner::Create(std::shared_ptr<RegisteredWorker> rank,
                                                                          std::shared_ptr<const RecordFiles> files,
                                                                          RecordStoreOptions store_options,
                                                                          LoaderMetrics* metrics, Answer answer) {
  if (rank == nullptr || rank->arena == nullptr) {
    return absl::InvalidArgumentError("a peer order runner needs a rank whose arena is mapped here");
  }
  if (files == nullptr) return absl::InvalidArgumentError("a peer order runner needs record files");
  store_options.buffers = std::max(store_options.buffers, store_options.queue_depth);
  ASSIGN_OR_RETURN(std::unique_ptr<RecordStore> store, RecordStore::Create(std::move(files), store_options));
  const SlotGeometry& g = rank->geometry;
  for (uint32_t layer : g.moe_layer_ids) {
    absl::StatusOr<uint64_t> rec_bytes = store->RecordBytes(rank->rank, layer);
    if (!rec_bytes.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("this streamer's release has no records for rank ", rank->rank, " layer ", layer));
    }
    if (*rec_bytes > g.rec_bytes) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", layer, " records are ", *rec_bytes,
                                                        " bytes, rank ", rank->rank, "'s slots ", g.rec_bytes));
    }
  }
  ASSIGN_OR_RETURN(EventFd wake, EventFd::Create());
  auto runner = std::unique_ptr<PeerOrderRunner>(new PeerOrderRunner(
      std::move(rank), std::move(store), store_options.buffers, std::move(wake), metrics, std::move(answer)));
  if (runner->idle_buffers_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rank ", runner->rank_->rank, ": no bounce buffer could be prepared as a copy source"));
  }
  runner->thread_ = std::thread([r = runner.get()] { r->Run(); });
  return runner;
}

PeerOrderRunner::PeerOrderRunner(std::shared_ptr<RegisteredWorker> rank, std::unique_ptr<RecordStore> store,
                                 unsigned buffers, EventFd wake, LoaderMetrics* metrics, Answer answer)
    : rank_(std::move(rank)), store_(std::move(store)), wake_(std::move(wake)), metrics_(metrics),
      answer_(std::move(answer)) {
  // Device arenas copy from page-locked memory; a buffer that cannot be prepared is not used.
  for (unsigned b = 0; b < buffers; ++b) {
    if (absl::Status s = rank_->arena->PrepareSource(store_->Buffer(b)); !s.ok()) {
      spdlog::warn("rank {}: bounce buffer {} not prepared, left out: {}", rank_->rank, b, s.ToString());
      continue;
    }
    prepared_buffers_.push_back(b);
  }
  idle_buffers_ = prepared_buffers_;
}

PeerOrderRunner::~PeerOrderRunner() {
  Stop();
  for (unsigned b : prepared_buffers_) rank_->arena->ReleaseSource(store_->Buffer(b));
}

void PeerOrderRunner::Order(nq::v1::LoadOrder order) {
  {
    absl::MutexLock lock(&mu_);
    incoming_.push_back(std::move(order));
  }
  if (absl::Status s = wake_.Signal(); !s.ok()) {
    spdlog::error("rank {}: peer order wake-up lost, it waits up to {} s: {}", rank_->rank,
                  absl::ToDoubleSeconds(kMaxSleep), s.ToString());
  }
}

void PeerOrderRunner::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  (void)wake_.Signal();
  if (thread_.joinable()) thread_.join();
}

PeerOrderRunner::Stats PeerOrderRunner::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::StatusOr<size_t> PeerOrderRunner::Check(const nq::v1::LoadOrder& order) const {
  const SlotGeometry& g = rank_->geometry;
  ASSIGN_OR_RETURN(size_t layer_index, g.LayerIndex(order.layer()));
  if (order.slot() >= g.slots_per_layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot ", order.slot(), " of layer ", order.layer(), ": the rank has ", g.slots_per_layer));
  }
  if (order.expert() >= g.experts_per_layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert ", order.expert(), ": the layers have ", g.experts_per_layer));
  }
  if (filling_.count({layer_index, order.slot()}) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", order.layer(), " slot ", order.slot(), " is still being filled by an earlier order"));
  }
  return layer_index;
}

void PeerOrderRunner::Reply(const nq::v1::LoadOrder& order, const absl::Status& status) {
  nq::v1::LoadResult result;
  result.set_load_id(order.load_id());
  result.set_ok(status.ok());
  if (!status.ok()) {
    result.set_error(status.ToString());
    static LogRateLimiter failure_log(std::chrono::seconds(10));
    if (long n = failure_log.Allow()) {
      spdlog::error("rank {}: the decider's order to load layer {} expert {} into slot {} failed: {} ({} since last "
                    "report)",
                    rank_->rank, order.layer(), order.expert(), order.slot(), status.ToString(), n);
    }
  }
  (status.ok() ? metrics_->peer_orders_ok : metrics_->peer_orders_failed).Increment();
  {
    absl::MutexLock lock(&mu_);
    ++(status.ok() ? stats_.loaded : stats_.failed);
  }
  answer_(result);
}

void PeerOrderRunner::Issue() {
  while (!waiting_.empty() && !idle_buffers_.empty()) {
    auto [order, layer_index] = std::move(waiting_.front());
    waiting_.pop_front();
    const unsigned buffer = idle_buffers_.back();
    const uint64_t tag = next_tag_++;
    absl::Status submitted = store_->Submit(ReadRequest{.rank = rank_->rank,
                                                        .layer = order.layer(),
                                                        .expert = order.expert(),
                                                        .buffer_index = static_cast<int>(buffer),
                                                        .tag = tag});
    if (!submitted.ok()) {
      filling_.erase({layer_index, order.slot()});
      Reply(order, submitted);
      continue;
    }
    idle_buffers_.pop_back();
    reading_.emplace(tag, Reading{.order = std::move(order), .layer_index = layer_index, .buffer = buffer});
  }
}

void PeerOrderRunner::Reap() {
  absl::StatusOr<std::vector<RecordCompletion>> done = store_->Poll();
  if (!done.ok()) {
    spdlog::error("rank {}: record store: {}", rank_->rank, done.status().ToString());
    return;
  }
  for (const RecordCompletion& completion : *done) {
    auto found = reading_.find(completion.tag);
    if (found == reading_.end()) continue;
    const Reading reading = std::move(found->second);
    reading_.erase(found);
    absl::Status status = completion.status;
    if (status.ok()) {
      metrics_->read_bytes.Increment(static_cast<double>(completion.bytes));
      metrics_->read_latency.Observe(completion.latency_seconds);
      const uint64_t offset = rank_->geometry.SlotOffset(reading.layer_index, reading.order.slot());
      status = rank_->arena->Write(offset, store_->Buffer(reading.buffer).first(completion.bytes));
    } else {
      metrics_->read_errors.WithLabels({completion.failure.empty() ? "other" : completion.failure}).Increment();
    }
    idle_buffers_.push_back(reading.buffer);
    filling_.erase({reading.layer_index, reading.order.slot()});
    Reply(reading.order, status);
  }
}

void PeerOrderRunner::Run() {
  while (true) {
    std::deque<nq::v1::LoadOrder> incoming;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
      incoming.swap(incoming_);
    }
    for (nq::v1::LoadOrder& order : incoming) {
      absl::StatusOr<size_t> layer_index = Check(order);
      if (!layer_index.ok()) {
        Reply(order, layer_index.status());
        continue;
      }
      filling_.insert({*layer_index, order.slot()});
      waiting_.emplace_back(std::move(order), *layer_index);
    }
    Issue();
    Reap();
    Issue();
    const int fds[] = {wake_.fd(), store_->completion_fd()};
    absl::StatusOr<std::vector<bool>> readable = WaitReadable(fds, kMaxSleep);
    if (absl::Status cleared = readable.ok() ? wake_.Clear() : readable.status(); !cleared.ok()) {
      spdlog::error("rank {}: peer order runner wait failed: {}", rank_->rank, cleared.ToString());
      absl::SleepFor(absl::Milliseconds(10));  // never spin on a persistent error
    }
  }
  // The link is going away: stop what can be stopped and let the rest land in our own buffers.
  for (const auto& [tag, reading] : reading_) (void)store_->Cancel(tag);
  while (store_->outstanding() > 0) {
    if (!store_->Wait().ok()) break;
  }
}

}  // namespace nq::streamer
