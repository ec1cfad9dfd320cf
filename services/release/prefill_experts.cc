#include "services/release/prefill_experts.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/elapsed.h"
#include "services/common/status_macros.h"

namespace nq::release {
namespace {

// Weight of the newest sample in the timings' exponential averages: a few layers settle them,
// and one slow read or layer moves them only a little.
constexpr double kTimingAlpha = 0.2;

void Blend(double& average, double sample) {
  if (!(sample > 0) || !std::isfinite(sample)) return;
  average = average > 0 ? (1 - kTimingAlpha) * average + kTimingAlpha * sample : sample;
}

// Without a reader of the caller's: one checked pread after another through the decoder.
class DecoderRecordReader final : public PrefillRecordReader {
 public:
  explicit DecoderRecordReader(const ReleaseExpertDecoder& decoder) : decoder_(decoder) {}
  std::vector<absl::Status> ReadMany(uint32_t layer, std::span<const PrefillRecordRead> reads) override {
    std::vector<absl::Status> statuses(reads.size());
    for (size_t i = 0; i < reads.size(); ++i) {
      absl::StatusOr<std::vector<std::byte>> record = decoder_.ReadRecord(layer, static_cast<uint32_t>(reads[i].expert));
      if (!record.ok()) {
        statuses[i] = record.status();
      } else if (record->size() != reads[i].destination.size()) {
        statuses[i] = absl::InternalError(absl::StrCat("layer ", layer, " expert ", reads[i].expert, ": a record of ",
                                                       record->size(), " bytes for ", reads[i].destination.size()));
      } else {
        std::copy(record->begin(), record->end(), reads[i].destination.begin());
      }
    }
    return statuses;
  }

 private:
  const ReleaseExpertDecoder& decoder_;
};

}  // namespace

PrefillReadBudget ReadTimeBudget(const PrefillTimings& timings, int64_t span_tokens, int64_t rec_bytes, int64_t slots,
                                 double late_read_share) {
  if (slots <= 0) return {.by_time = true};
  const double layer_seconds = timings.seconds_per_token_layer * static_cast<double>(std::max<int64_t>(span_tokens, 0));
  const double records = layer_seconds * timings.read_bytes_per_second / static_cast<double>(rec_bytes);
  const double cap = static_cast<double>(slots);
  return {.prefetch = static_cast<int64_t>(std::clamp(std::floor(records), 1.0, cap)),
          .late = static_cast<int64_t>(std::clamp(std::floor(records * std::max(late_read_share, 0.0)), 0.0, cap)),
          .by_time = true};
}

absl::StatusOr<std::unique_ptr<PrefillExperts>> PrefillExperts::Create(const ReleaseExpertDecoder& decoder,
                                                                       kernels::Backend& backend, int64_t num_experts,
                                                                       PrefillExpertsOptions options) {
  if (options.slots < 0 || options.max_borrowed_slots < 0 || options.slots + options.max_borrowed_slots <= 0 ||
      options.full_span_tokens <= 0 || num_experts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill experts: ", options.slots, " slots, ", options.max_borrowed_slots, " to borrow and a full span of ",
        options.full_span_tokens, " tokens for ", num_experts,
        " experts (want slot counts >= 0, at least one slot own or borrowed, and a positive span)"));
  }
  ASSIGN_OR_RETURN(const ReleaseExpertDecoder::SlotNeeds needs, decoder.Needs());
  const int64_t slot_bytes = static_cast<int64_t>(needs.rec_bytes);
  if (options.reader == nullptr) options.reader = std::make_shared<DecoderRecordReader>(decoder);
  // More slots than a layer has experts never serve it.
  const int64_t max_borrowed = std::min(options.max_borrowed_slots, std::max<int64_t>(num_experts - options.slots, 0));
  if (options.slots + max_borrowed <= 0) {
    return absl::InvalidArgumentError("prefill experts: no slots (own or borrowed) to hold an expert");
  }
  std::unique_ptr<PrefillExperts> experts(
      new PrefillExperts(decoder, backend, num_experts, options, slot_bytes, max_borrowed));
  const int64_t staged_slots = options.slots + max_borrowed;
  for (Buffer& b : experts->buffers_) {
    // O_DIRECT reads land straight in the slots: each slot starts at a 4096-byte boundary
    // (rec_bytes are multiples of it).
    constexpr size_t kAlign = 4096;
    const size_t bytes = static_cast<size_t>(staged_slots * slot_bytes);
    ASSIGN_OR_RETURN(b.staging, backend.AllocateHostStaging(bytes + kAlign));
    const std::span<std::byte> staging(static_cast<std::byte*>(b.staging->data()), bytes + kAlign);
    const size_t skew = reinterpret_cast<uintptr_t>(staging.data()) % kAlign;
    b.host = staging.subspan(skew == 0 ? 0 : kAlign - skew, bytes);
    b.expert_in.assign(static_cast<size_t>(options.slots), -1);
  }
  if (options.slots > 0) {
    ASSIGN_OR_RETURN(experts->device_,
                     backend.Allocate(kernels::DType::kU8, kernels::Shape{options.slots * slot_bytes}));
  }
  return experts;
}

PrefillExperts::PrefillExperts(const ReleaseExpertDecoder& decoder, kernels::Backend& backend,
                               int64_t num_experts, PrefillExpertsOptions options, int64_t slot_bytes,
                               int64_t max_borrowed)
    : decoder_(decoder),
      backend_(backend),
      num_experts_(num_experts),
      options_(options),
      slot_bytes_(slot_bytes),
      max_borrowed_(max_borrowed),
      num_slots_(options.slots),
      calls_4bit_(metrics::Registry::Default().Counter("nq_expert_calls_total", "", {"bits"}).WithLabels({"4"})),
      calls_2bit_(metrics::Registry::Default().Counter("nq_expert_calls_total", "", {"bits"}).WithLabels({"2"})),
      prefill_calls_4bit_(metrics::Registry::Default()
                              .Counter("nq_worker_prefill_expert_calls_total",
                                       "Routed expert calls (token x expert) of layer-major prefills, by precision "
                                       "(also counted in nq_expert_calls_total)",
                                       {"bits"})
                              .WithLabels({"4"})),
      prefill_calls_2bit_(
          metrics::Registry::Default().Counter("nq_worker_prefill_expert_calls_total", "", {"bits"}).WithLabels({"2"})),
      records_prefetched_(metrics::Registry::Default()
                              .Counter("nq_worker_prefill_records_total",
                                       "4-bit residual records a layer-major prefill ran, by how they arrived: "
                                       "prefetched while the layer before computed, read late, or copied from a "
                                       "READY slot",
                                       {"arrival"})
                              .WithLabels({"prefetched"})),
      records_late_(
          metrics::Registry::Default().Counter("nq_worker_prefill_records_total", "", {"arrival"}).WithLabels({"late"})),
      records_from_slots_(
          metrics::Registry::Default().Counter("nq_worker_prefill_records_total", "", {"arrival"}).WithLabels({"slot"})),
      borrowed_gauge_(metrics::Registry::Default()
                          .Gauge("nq_worker_prefill_borrowed_slots",
                                 "Expert slots a running layer-major prefill holds in room borrowed from the free KV "
                                 "cache (0 between prefills)")
                          .Get()),
      borrows_(metrics::Registry::Default()
                   .Counter("nq_worker_prefill_borrows_total",
                            "Layer-major prefills that borrowed expert slots from the free KV cache")
                   .Get()) {}

PrefillExperts::~PrefillExperts() {
  End();
  // An upload may still read the host buffers being freed.
  if (absl::Status s = backend_.Synchronize(); !s.ok()) spdlog::warn("prefill experts: {}", s.ToString());
}

PrefillReadBudget PrefillExperts::Budget(int64_t span_tokens) const {
  const int64_t slots = num_slots_;
  if (slots <= 0) return {};
  if (span_tokens >= options_.full_span_tokens) return {.prefetch = slots, .late = slots};
  if (const PrefillTimings t = timings(); options_.late_read_share > 0 && t.measured()) {
    return ReadTimeBudget(t, span_tokens, slot_bytes_, slots, options_.late_read_share);
  }
  const int64_t scaled =
      (slots * std::max<int64_t>(span_tokens, 0) + options_.full_span_tokens - 1) / options_.full_span_tokens;
  const int64_t n = std::clamp<int64_t>(scaled, 1, slots);
  return {.prefetch = n, .late = n};
}

PrefillTimings PrefillExperts::timings() const {
  absl::MutexLock lock(&timings_mu_);
  return timings_;
}

void PrefillExperts::ObserveRead(int64_t bytes, double seconds) {
  absl::MutexLock lock(&timings_mu_);
  if (seconds > 0) Blend(timings_.read_bytes_per_second, static_cast<double>(bytes) / seconds);
}

void PrefillExperts::ObserveLayerCompute(double seconds) {
  if (span_tokens_ <= 0) return;
  absl::MutexLock lock(&timings_mu_);
  Blend(timings_.seconds_per_token_layer, seconds / static_cast<double>(span_tokens_));
}

int64_t PrefillExperts::NextMoeLayer(int64_t layer) const {
  for (uint32_t id : decoder_.moe_layer_ids()) {
    if (options_.decoder_layers > 0 && static_cast<int64_t>(id) >= options_.decoder_layers) break;
    if (static_cast<int64_t>(id) > layer) return id;
  }
  return -1;
}

std::vector<absl::Status> PrefillExperts::ReadSlots(Buffer& b, int64_t layer,
                                                    std::span<const std::pair<int32_t, int64_t>> reads) {
  std::vector<absl::Status> statuses(reads.size());
  if (reads.empty()) return statuses;
  absl::StatusOr<uint64_t> rec_bytes = decoder_.RecordBytes(static_cast<uint32_t>(layer));
  if (!rec_bytes.ok() || static_cast<int64_t>(*rec_bytes) > slot_bytes_) {
    const absl::Status bad = rec_bytes.ok() ? absl::InternalError(absl::StrCat("layer ", layer, ": records of ",
                                                                                *rec_bytes, " bytes in slots of ",
                                                                                slot_bytes_))
                                            : rec_bytes.status();
    std::fill(statuses.begin(), statuses.end(), bad);
    return statuses;
  }
  const size_t bytes = static_cast<size_t>(*rec_bytes);
  std::vector<PrefillRecordRead> batch;
  for (const auto& [expert, slot] : reads) {
    b.expert_in[static_cast<size_t>(slot)] = -1;
    batch.push_back({.expert = expert, .destination = b.host.subspan(static_cast<size_t>(slot * slot_bytes_), bytes)});
  }
  const auto started = std::chrono::steady_clock::now();
  statuses = options_.reader->ReadMany(static_cast<uint32_t>(layer), batch);
  if (statuses.size() != reads.size()) {
    statuses.assign(reads.size(), absl::InternalError("prefill record reader: one status per read expected"));
  }
  int64_t landed = 0;
  for (size_t i = 0; i < reads.size(); ++i) {
    if (!statuses[i].ok()) continue;
    b.expert_in[static_cast<size_t>(reads[i].second)] = reads[i].first;
    landed += static_cast<int64_t>(bytes);
  }
  ObserveRead(landed, SecondsSince(started));
  return statuses;
}

absl::Status PrefillExperts::Prefetch(Buffer& b, int64_t layer, std::vector<int32_t> experts) {
  b.layer = layer;
  std::fill(b.expert_in.begin(), b.expert_in.end(), -1);
  std::vector<std::pair<int32_t, int64_t>> reads;
  for (size_t i = 0; i < experts.size() && static_cast<int64_t>(i) < num_slots_; ++i) {
    reads.emplace_back(experts[i], static_cast<int64_t>(i));
  }
  // A record that fails (a read error, or damaged: it fails its checksum) leaves its slot empty
  // and the rest are still read; the first failure is reported.
  for (const absl::Status& read : ReadSlots(b, layer, reads)) {
    if (!read.ok()) return read;
  }
  return absl::OkStatus();
}

void PrefillExperts::StartPrefetch(int64_t layer) {
  if (layer < 0 || num_slots_ <= 0) return;
  // Which experts a layer's span will route is known only after its attention: prefetch the
  // manifest's ranking (most valuable first), as many as the budget allows. A long span routes
  // nearly every expert, so a budget of all slots prefetches nearly exactly what it needs.
  std::vector<int32_t> experts;
  const format::ManifestLayer* ml = decoder_.release().manifest().FindLayer(static_cast<uint32_t>(layer));
  if (ml != nullptr) {
    experts.assign(ml->ranking.begin(), ml->ranking.end());
  } else {
    experts.resize(static_cast<size_t>(num_experts_));
    std::iota(experts.begin(), experts.end(), 0);
  }
  experts.resize(std::min<size_t>(experts.size(), static_cast<size_t>(budget_.prefetch)));
  Buffer& b = buffers_[1 - current_];
  prefetch_ = std::async(std::launch::async, [this, &b, layer, experts = std::move(experts)]() mutable {
    return Prefetch(b, layer, std::move(experts));
  });
}

absl::Status PrefillExperts::WaitPrefetch() {
  if (!prefetch_.valid()) return absl::OkStatus();
  return prefetch_.get();
}

void PrefillExperts::Borrow(model::Model& lender, int64_t span_tokens) {
  // The span's rows [L0, L0 + T) are written by the prefill; past them the cache is free.
  const int64_t from_token = lender.cache_length() + std::max<int64_t>(span_tokens, 0);
  if (from_token >= lender.max_tokens()) return;  // no room (or a span the prefill itself refuses)
  absl::StatusOr<model::KvLoan> loan = lender.LendKvRoom(from_token, slot_bytes_, max_borrowed_);
  if (!loan.ok()) {
    // Borrowing buys precision, never correctness: the prefill runs on its own slots.
    spdlog::warn("layer-major prefill: no slots borrowed from the KV cache: {}", loan.status().ToString());
    return;
  }
  loan_ = *std::move(loan);
  if (loan_.records().empty()) return;
  ++prefills_borrowed_;
  borrows_.Increment();
  borrowed_gauge_.Increment(static_cast<double>(loan_.records().size()));
  spdlog::debug("layer-major prefill of {} tokens: {} slots borrowed from the KV cache past row {}", span_tokens,
                loan_.records().size(), from_token);
}

void PrefillExperts::Begin(int64_t span_tokens, model::Model* lender) {
  End();
  // A prefill that stopped early may have left an upload in flight from the buffer the prefetch
  // below writes.
  if (absl::Status s = backend_.Synchronize(); !s.ok()) spdlog::warn("prefill experts: {}", s.ToString());
  span_tokens_ = span_tokens;
  if (lender != nullptr && max_borrowed_ > 0) Borrow(*lender, span_tokens);
  num_slots_ = options_.slots + borrowed_slots();
  for (Buffer& b : buffers_) b.expert_in.assign(static_cast<size_t>(num_slots_), -1);
  budget_ = Budget(span_tokens);
  last_hook_return_.reset();
  if (budget_.by_time) {
    const PrefillTimings t = timings();
    spdlog::debug("layer-major prefill of {} tokens: up to {} records a layer prefetched and {} read late ({:.3f} ms "
                  "of compute a layer, reads at {:.2f} GB/s)",
                  span_tokens, budget_.prefetch, budget_.late,
                  1e3 * t.seconds_per_token_layer * static_cast<double>(span_tokens), t.read_bytes_per_second / 1e9);
  }
  for (Buffer& b : buffers_) b.layer = -1;
  // StartPrefetch fills the buffer BeforeMoe does not hand out next; flip so the first MoE
  // layer's prefetch lands in the one it does.
  current_ = 1 - current_;
  StartPrefetch(decoder_.moe_layer_ids().empty() ? -1 : decoder_.moe_layer_ids().front());
  current_ = 1 - current_;
}

void PrefillExperts::End() {
  if (absl::Status s = WaitPrefetch(); !s.ok()) spdlog::warn("prefill prefetch: {}", s.ToString());
  if (loan_.outstanding()) {
    // The last layer's NqMoe (and its uploads) may still be queued on the device: once this
    // returns nothing reads or writes the borrowed rows, and the next forward may overwrite them.
    if (absl::Status s = backend_.Synchronize(); !s.ok()) spdlog::warn("prefill experts: {}", s.ToString());
    borrowed_gauge_.Decrement(static_cast<double>(loan_.records().size()));
    loan_.Return();
  }
  num_slots_ = options_.slots;
  for (Buffer& b : buffers_) {
    b.layer = -1;
    b.expert_in.assign(static_cast<size_t>(num_slots_), -1);
  }
}

absl::StatusOr<std::optional<model::Model::PrefillLayerSlots>> PrefillExperts::BeforeMoe(
    int64_t layer, std::span<const model::MoeRouting> chunks) {
  const std::vector<uint32_t>& held = decoder_.moe_layer_ids();
  if (std::find(held.begin(), held.end(), static_cast<uint32_t>(layer)) == held.end()) return std::nullopt;
  if (last_hook_return_.has_value()) ObserveLayerCompute(SecondsSince(*last_hook_return_));
  Buffer& b = buffers_[current_];
  if (absl::Status s = WaitPrefetch(); !s.ok()) {
    // A failed read costs precision, not the request: what is missing is read again below,
    // and an expert that still cannot be read runs at 2 bits.
    spdlog::warn("prefill prefetch of layer {}: {}", layer, s.ToString());
  }
  // No slot at all (none own, and the cache lent none for this span): the layer runs as a
  // token-order forward would, on the model's usual slots.
  if (num_slots_ <= 0) {
    last_hook_return_ = std::chrono::steady_clock::now();
    return std::nullopt;
  }
  if (b.layer != layer) {
    b.layer = layer;
    std::fill(b.expert_in.begin(), b.expert_in.end(), -1);
  }
  std::vector<int64_t> calls(static_cast<size_t>(num_experts_), 0);
  for (const model::MoeRouting& r : chunks) {
    for (int32_t e : r.experts) {
      if (e >= 0 && e < num_experts_) ++calls[static_cast<size_t>(e)];
    }
  }
  // The span's experts, most-routed first (ties: the lower id); of the first budget_.prefetch,
  // up to budget_.late are read if the prefetch missed them.
  std::vector<int32_t> used;
  for (int32_t e = 0; e < num_experts_; ++e) {
    if (calls[static_cast<size_t>(e)] > 0) used.push_back(e);
  }
  std::stable_sort(used.begin(), used.end(),
                   [&](int32_t a, int32_t c) { return calls[static_cast<size_t>(a)] > calls[static_cast<size_t>(c)]; });
  const size_t chosen = static_cast<size_t>(budget_.prefetch);
  int64_t late_reads = 0;
  std::vector<int32_t> slot_of(static_cast<size_t>(num_experts_), -1);
  std::vector<int64_t> free_slots;
  // Slots whose prefetched expert the span routes keep it (already read); the others are free.
  for (int64_t s = num_slots_ - 1; s >= 0; --s) {
    const int32_t e = b.expert_in[static_cast<size_t>(s)];
    if (e >= 0 && calls[static_cast<size_t>(e)] > 0) {
      slot_of[static_cast<size_t>(e)] = static_cast<int32_t>(s);
      ++totals_.records_prefetched_used;
      records_prefetched_.Increment();
    } else {
      free_slots.push_back(s);
    }
  }
  // A prefetched expert the span does not use may be overwritten: forget it first.
  for (int64_t s : free_slots) b.expert_in[static_cast<size_t>(s)] = -1;
  const int64_t layer_bytes = static_cast<int64_t>(decoder_.RecordBytes(static_cast<uint32_t>(layer)).value_or(0));
  std::vector<std::pair<int32_t, int64_t>> late;  // (expert, slot) the prefetch missed, to read
  for (size_t i = 0; i < used.size() && !free_slots.empty(); ++i) {
    const int32_t e = used[i];
    if (slot_of[static_cast<size_t>(e)] >= 0) continue;
    const int64_t s = free_slots.back();
    const std::span<std::byte> dst =
        b.host.subspan(static_cast<size_t>(s * slot_bytes_), static_cast<size_t>(layer_bytes));
    if (options_.copy_ready && layer_bytes > 0 && options_.copy_ready(layer, e, dst)) {
      b.expert_in[static_cast<size_t>(s)] = e;
      ++totals_.records_from_slots;
      records_from_slots_.Increment();
    } else if (i < chosen && late_reads < budget_.late) {
      ++late_reads;
      late.emplace_back(e, s);  // read below, all at once
    } else {
      continue;  // past the read budget, and no slot holds it: 2 bits
    }
    free_slots.pop_back();
    slot_of[static_cast<size_t>(e)] = static_cast<int32_t>(s);
  }
  const std::vector<absl::Status> late_reads_done = ReadSlots(b, layer, late);
  for (size_t i = 0; i < late.size(); ++i) {
    const auto [e, s] = late[i];
    if (!late_reads_done[i].ok()) {
      // Its slot stays empty for this layer: one failed record costs its own precision only.
      spdlog::warn("prefill: layer {} expert {} stays at 2 bits: {}", layer, e, late_reads_done[i].ToString());
      slot_of[static_cast<size_t>(e)] = -1;
      continue;
    }
    ++totals_.records_read_late;
    records_late_.Increment();
  }
  // The device slots (own and borrowed) were last read by the MoE of the layer before; the
  // upload must not overtake that work on a device that queues it. (The routing of this layer
  // came to the host, so the device has little left to finish.) The upload itself runs without
  // the host waiting: the host buffer is written again only by the prefetch the next BeforeMoe
  // starts, after its own Synchronize.
  RETURN_IF_ERROR(backend_.Synchronize());
  RETURN_IF_ERROR(Upload(b, slot_of));
  for (int32_t e = 0; e < num_experts_; ++e) {
    const double n = static_cast<double>(calls[static_cast<size_t>(e)]);
    if (n == 0) continue;
    const bool four = slot_of[static_cast<size_t>(e)] >= 0;
    (four ? totals_.calls_4bit : totals_.calls_2bit) += n;
    (four ? calls_4bit_ : calls_2bit_).Increment(n);
    (four ? prefill_calls_4bit_ : prefill_calls_2bit_).Increment(n);
  }
  // The next layer's reads overlap this layer's experts (and the next layer's attention).
  StartPrefetch(NextMoeLayer(layer));
  model::Model::PrefillLayerSlots slots = LayerSlots(std::move(slot_of));
  current_ = 1 - current_;
  last_hook_return_ = std::chrono::steady_clock::now();
  return slots;
}

absl::Status PrefillExperts::Upload(const Buffer& b, std::span<const int32_t> slot_of) {
  const size_t slot = static_cast<size_t>(slot_bytes_);
  if (options_.slots > 0) {
    RETURN_IF_ERROR(backend_.CopyFromHost(b.host.first(static_cast<size_t>(options_.slots) * slot), device_));
  }
  // A borrowed piece is written only when the layer runs the expert it holds: one copy per
  // record, each into its own cache tensor.
  std::vector<bool> runs(static_cast<size_t>(num_slots_), false);
  for (int32_t s : slot_of) {
    if (s >= 0) runs[static_cast<size_t>(s)] = true;
  }
  for (int64_t i = 0; i < borrowed_slots(); ++i) {
    const int64_t s = options_.slots + i;
    if (!runs[static_cast<size_t>(s)]) continue;
    const model::KvLentRecord& piece = loan_.records()[static_cast<size_t>(i)];
    RETURN_IF_ERROR(backend_.CopyFromHostAt(b.host.subspan(static_cast<size_t>(s) * slot, slot), *piece.tensor,
                                            piece.range.offset));
  }
  return absl::OkStatus();
}

model::Model::PrefillLayerSlots PrefillExperts::LayerSlots(std::vector<int32_t> slot_of) const {
  model::Model::PrefillLayerSlots slots{.arena = static_cast<const std::byte*>(device_.data()),
                                        .slot_bytes = slot_bytes_,
                                        .num_slots = num_slots_,
                                        .slot_of_expert = std::move(slot_of),
                                        .slot_records = {}};
  if (borrowed_slots() > 0) {
    for (int64_t s = 0; s < options_.slots; ++s) slots.slot_records.push_back(slots.arena + s * slot_bytes_);
    for (const model::KvLentRecord& piece : loan_.records()) slots.slot_records.push_back(piece.address());
  }
  return slots;
}

}  // namespace nq::release
