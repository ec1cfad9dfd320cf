// 4-bit routed experts for a layer-major prefill (issue #23). During a long prefill each MoE
// layer runs once over the whole span (Model::PrefillLayerMajor), so the worker can afford to
// hold that layer's routed experts at 4 bits just for the prefill, even those the decode-time
// predictor keeps at 2:
//
//   Begin(span, lender)         borrow slots from the lender's free KV cache; prefetch the first
//                               MoE layer's likely experts (manifest ranking)
//   BeforeMoe(L, chunk routing) the experts the span routes most, up to the budget: those the
//                               prefetch missed are read now; upload; prefetch the next layer
//   End()                       wait for a prefetch still in flight; return the borrowed slots
//
// Memory: `slots` record-sized slots of this object's own on the backend (one device buffer: a
// layer's upload waits for the layer before to finish, so one at a time is read), and two host
// buffers of staging (the one layer L uploads from, the one the prefetch fills for the next
// layer), owned by this object alone and apart from the streamer's slot arena: the slot
// protocol's slots are never touched. Records are read by PrefillExpertsOptions::reader, a
// batch at once (the worker's: the streamer's io_uring store), or else with
// ReleaseExpertDecoder::ReadRecord, one after another; either way each is checked against its
// checksum in the index.
//
// Slot borrowing (issue #23): the KV cache past the span (rows [L0 + T, max_tokens) of every
// cache tensor, services/model/kv_loan.h) holds nothing anyone reads while the prefill runs, so
// Begin borrows up to max_borrowed_slots record-sized pieces of it from the model
// (Model::LendKvRoom) as extra slots: a layer's slots are the own ones, then the borrowed ones,
// and slot_of_expert indexes that list (PrefillLayerSlots::slot_records). A borrowed slot is
// LENT from Begin to End: written only by a layer's upload (CopyFromHostAt, after the
// Synchronize that ends the layer before's kernels), read only by that layer's NqMoe; End
// synchronizes and returns the loan, after which nothing here touches those rows and the next
// forward may overwrite them. While lent, the model refuses any forward that would write them.
// The host staging has room for the borrowed slots too (staging is where reads land).
//
// Budget: a span of at least full_span_tokens loads every expert its chunks use (up to the
// slots). A shorter span reads the most-routed ones within a time budget, once this object has
// measured a layer's compute and its own reads (ReadTimeBudget): the prefetch reads what one
// layer's compute hides, and the reads the prefetch missed (read late, nothing hides them) at
// most late_read_share of that compute, so the reads slow a prefill by at most that share
// (issue #23: prefill at >= 0.8x the all-2-bit prefill's throughput). Before the first
// measurement (a worker's first layer-major prefill) the budget is by tokens instead,
// ceil(slots * span / full_span_tokens) for the prefetch and again for the late reads: the reads
// grow with the experts, the compute that hides them with the span's tokens. Experts
// that cost no read come on top while slots remain: prefetched ones the span routes, and
// residuals already at hand (a worker's READY slots, PrefillExpertsOptions::copy_ready).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "services/common/metrics/registry.h"
#include "services/model/model.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

// One record a PrefillRecordReader reads: `expert`'s record of the layer into `destination`
// (exactly the layer's rec_bytes, aligned to 4096 bytes).
struct PrefillRecordRead {
  int32_t expert = 0;
  std::span<std::byte> destination;
};

// How a layer-major prefill reads records: all of a batch at once where the reader can (the
// worker's reader runs the streamer's io_uring store, O_DIRECT, many reads in flight,
// services/worker/prefill_record_reader.h), each checked against its checksum in the index.
// Called from one thread at a time (the prefetch thread, then the prefill's).
class PrefillRecordReader {
 public:
  virtual ~PrefillRecordReader() = default;
  // One status per read, in order: OK once the record landed whole and matched its checksum.
  virtual std::vector<absl::Status> ReadMany(uint32_t layer, std::span<const PrefillRecordRead> reads) = 0;
};

struct PrefillExpertsOptions {
  // Own slots: how many of a layer's experts can run at 4 bits during the prefill without
  // borrowing (n_routed_experts holds them all). May be 0 when max_borrowed_slots is not.
  int64_t slots = 0;
  // Slots a prefill may borrow from the free KV cache on top of `slots` (Begin's lender), at
  // most n_routed_experts - slots (more never serve a layer). 0: no borrowing.
  int64_t max_borrowed_slots = 0;
  int64_t full_span_tokens = 32768;
  // The model's decoder layers (num_hidden_layers): a prefill never runs the MTP layers past
  // them, so nothing is prefetched there. 0: every MoE layer of the release.
  int64_t decoder_layers = 0;
  // The share of a layer's compute the late reads may add (above); <= 0 keeps the budget by
  // tokens even once timings are measured.
  double late_read_share = 0.25;
  // Reads the records (null: ReleaseExpertDecoder::ReadRecord, one pread after another).
  std::shared_ptr<PrefillRecordReader> reader;
  // Fills `out` (rec_bytes of the layer) with (layer, expert)'s residual when one is already at
  // hand -- a worker's READY slot -- and says whether it did. Such experts cost no read, so
  // they come on top of the budget while slots remain. May be empty. Called from BeforeMoe.
  std::function<bool(int64_t layer, int32_t expert, std::span<std::byte> out)> copy_ready;
};

// Expert calls (token x expert) of layer-major prefills, by precision, and how the records
// arrived.
struct PrefillExpertStats {
  double calls_4bit = 0;
  double calls_2bit = 0;
  int64_t records_prefetched_used = 0;  // prefetched and then routed
  int64_t records_read_late = 0;        // read in BeforeMoe, the prefetch having missed them
  int64_t records_from_slots = 0;       // copied from a READY slot (copy_ready)
  double CallShare4Bit() const {
    return calls_4bit + calls_2bit > 0 ? calls_4bit / (calls_4bit + calls_2bit) : 0;
  }
};

// What the time budget is computed from: a layer's compute per span token (from one MoE layer's
// hook returning to the next one's call: its experts, then the next layer's attention and
// routing, which the prefetch overlaps) and the rate records are read at.
struct PrefillTimings {
  double seconds_per_token_layer = 0;
  double read_bytes_per_second = 0;
  bool measured() const { return seconds_per_token_layer > 0 && read_bytes_per_second > 0; }
};

// Records a layer may read for a span: prefetched (hidden behind the compute of the layer before)
// and late (the prefetch missed them; they add to the prefill's time).
struct PrefillReadBudget {
  int64_t prefetch = 0;
  int64_t late = 0;
  bool by_time = false;  // from measured timings, or by tokens before any
};

// The time budget for `span_tokens` (PrefillTimings measured, rec_bytes > 0): the prefetch as
// many records as one layer's compute reads, at least 1; late reads late_read_share of it.
// Both at most `slots`.
PrefillReadBudget ReadTimeBudget(const PrefillTimings& timings, int64_t span_tokens, int64_t rec_bytes, int64_t slots,
                                 double late_read_share);

class PrefillExperts {
 public:
  // `decoder` and `backend` must outlive this. INVALID_ARGUMENT for negative slot counts, no
  // slots at all (own or borrowed) or full_span_tokens <= 0; the backend's allocation errors.
  static absl::StatusOr<std::unique_ptr<PrefillExperts>> Create(const ReleaseExpertDecoder& decoder,
                                                                kernels::Backend& backend, int64_t num_experts,
                                                                PrefillExpertsOptions options);
  ~PrefillExperts();

  // A layer-major prefill of `span_tokens` starts at lender->cache_length() (lender may be null:
  // no borrowing): borrow what free room past the span lends (up to max_borrowed_slots), then
  // prefetch the first MoE layer. The lender must not run another forward before End.
  void Begin(int64_t span_tokens, model::Model* lender = nullptr);
  // Model::LayerMajorOptions::before_moe. The slots stay valid until the next call or End.
  // nullopt for a layer the release does not hold, or when this prefill has no slot at all (no
  // own ones, and the cache lent none): the model's usual slots serve the layer.
  absl::StatusOr<std::optional<model::Model::PrefillLayerSlots>> BeforeMoe(int64_t layer,
                                                                          std::span<const model::MoeRouting> chunks);
  // The prefill stopped (done, failed or cancelled): waits for the prefetch, and returns the
  // borrowed slots once no kernel can read them (after a Synchronize).
  void End();

  // Experts of a layer loaded for a span of `span_tokens` (the budget above), with this
  // prefill's slots (own and borrowed; outside a prefill, the own ones).
  PrefillReadBudget Budget(int64_t span_tokens) const;
  // What this object measured so far (exponential averages over its prefills).
  PrefillTimings timings() const;
  // Totals over every prefill so far (the nq_worker_prefill_* metrics count the same).
  const PrefillExpertStats& totals() const { return totals_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t slots() const { return options_.slots; }
  // The most slots a prefill borrows (the option, capped at n_routed_experts - slots).
  int64_t max_borrowed_slots() const { return max_borrowed_; }
  // Slots borrowed by the prefill running (0 outside Begin..End), and the loan itself.
  int64_t borrowed_slots() const { return static_cast<int64_t>(loan_.records().size()); }
  const model::KvLoan& loan() const { return loan_; }
  // Prefills that borrowed at least one slot, over this object's life.
  int64_t prefills_borrowed() const { return prefills_borrowed_; }

 private:
  struct Buffer {
    int64_t layer = -1;
    // Host memory the reads land in: the backend's host staging (page-locked on CUDA, so the
    // upload runs at the bus's speed without the host waiting), with room to align it.
    std::unique_ptr<kernels::Storage> staging;
    // (slots + max_borrowed) x slot_bytes at a 4096-byte boundary, filled by reads: slot s at
    // s x slot_bytes, own and borrowed alike.
    std::span<std::byte> host;
    std::vector<int32_t> expert_in;  // expert held by each slot of this prefill, -1 none
  };
  PrefillExperts(const ReleaseExpertDecoder& decoder, kernels::Backend& backend, int64_t num_experts,
                 PrefillExpertsOptions options, int64_t slot_bytes, int64_t max_borrowed);
  // Borrows from `lender` for a span of span_tokens at its cache's end (Begin).
  void Borrow(model::Model& lender, int64_t span_tokens);
  // Uploads the slots of `b` the layer runs (`slot_of`): the own ones at once, each borrowed one
  // that holds an expert into its piece of the KV cache.
  absl::Status Upload(const Buffer& b, std::span<const int32_t> slot_of);
  // The layer's slots for the model: one arena, or the own then borrowed records' addresses.
  model::Model::PrefillLayerSlots LayerSlots(std::vector<int32_t> slot_of) const;
  // Reads `experts` of `layer` into `b`'s slots (replacing what it held).
  absl::Status Prefetch(Buffer& b, int64_t layer, std::vector<int32_t> experts);
  // Reads each (expert, slot) of `reads` into its slot of `b` (options.reader, or one pread
  // after another), timing the batch; one status per read. A slot whose read failed holds no
  // expert.
  std::vector<absl::Status> ReadSlots(Buffer& b, int64_t layer, std::span<const std::pair<int32_t, int64_t>> reads);
  void ObserveRead(int64_t bytes, double seconds);
  void ObserveLayerCompute(double seconds);
  // The next MoE layer after `layer` the release holds, or -1.
  int64_t NextMoeLayer(int64_t layer) const;
  void StartPrefetch(int64_t layer);
  absl::Status WaitPrefetch();

  const ReleaseExpertDecoder& decoder_;
  kernels::Backend& backend_;
  const int64_t num_experts_;
  const PrefillExpertsOptions options_;
  const int64_t slot_bytes_;
  const int64_t max_borrowed_;
  kernels::Tensor device_;  // U8 [slots x slot_bytes] on the backend (none with 0 own slots)
  Buffer buffers_[2];
  model::KvLoan loan_;  // the borrowed slots of the prefill running
  int64_t num_slots_;   // this prefill's slots: own, then borrowed
  int64_t prefills_borrowed_ = 0;
  int current_ = 0;  // the buffer BeforeMoe hands out; the other one is prefetched
  std::future<absl::Status> prefetch_;
  int64_t span_tokens_ = 0;
  PrefillReadBudget budget_;  // of the current span, fixed at Begin
  // When the last BeforeMoe of this prefill returned (the next one's call ends that compute).
  std::optional<std::chrono::steady_clock::time_point> last_hook_return_;
  mutable absl::Mutex timings_mu_;  // reads are timed on the prefetch thread too
  PrefillTimings timings_ ABSL_GUARDED_BY(timings_mu_);
  PrefillExpertStats totals_;
  metrics::Counter& calls_4bit_;
  metrics::Counter& calls_2bit_;
  metrics::Counter& prefill_calls_4bit_;
  metrics::Counter& prefill_calls_2bit_;
  metrics::Counter& records_prefetched_;
  metrics::Counter& records_late_;
  metrics::Counter& records_from_slots_;
  metrics::Gauge& borrowed_gauge_;
  metrics::Counter& borrows_;
};

}  // namespace nq::release
