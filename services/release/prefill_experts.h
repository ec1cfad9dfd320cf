// 4-bit routed experts for a layer-major prefill (issue #23). During a long prefill each MoE
// layer runs once over the whole span (Model::PrefillLayerMajor), so the worker can afford to
// hold that layer's routed experts at 4 bits just for the prefill, even those the decode-time
// predictor keeps at 2:
//
//   Begin(span)                 prefetch the first MoE layer's likely experts (manifest ranking)
//   BeforeMoe(L, chunk routing) the experts the span routes most, up to the budget: those the
//                               prefetch missed are read now; upload; prefetch the next layer
//   End()                       wait for a prefetch still in flight
//
// Memory: two buffers of `slots` record-sized slots (one the model reads for layer L, one the
// prefetch fills for the next layer), owned by this object alone and apart from the streamer's
// slot arena: the slot protocol's slots are never touched, so its one-owner invariant holds
// trivially. (Borrowing room from the free KV cache instead is issue #23's slot borrowing,
// not done here.) Records are read from the release with ReleaseExpertDecoder::ReadRecord.
//
// Budget: a span of at least full_span_tokens loads every expert its chunks use (up to the
// slots); a shorter span reads the most-routed ones, ceil(slots * span / full_span_tokens) of
// them -- the number of reads grows with the experts, the compute that hides them with the
// span's tokens, so this keeps the reads' share of the prefill time about constant. (The
// prefetch reads up to the budget by the manifest's ranking, before the routing is known, and
// the late reads up to the budget of the most-routed it missed: at most twice the budget, the
// prefetch's half overlapped with compute.) Experts
// that cost no read come on top while slots remain: prefetched ones the span routes, and
// residuals already at hand (a worker's READY slots, PrefillExpertsOptions::copy_ready).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/common/metrics/registry.h"
#include "services/model/model.h"
#include "services/release/release_expert_decoder.h"

namespace nq::release {

struct PrefillExpertsOptions {
  // Slots per buffer: how many of a layer's experts can run at 4 bits during the prefill
  // (n_routed_experts holds them all).
  int64_t slots = 0;
  int64_t full_span_tokens = 32768;
  // The model's decoder layers (num_hidden_layers): a prefill never runs the MTP layers past
  // them, so nothing is prefetched there. 0: every MoE layer of the release.
  int64_t decoder_layers = 0;
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

class PrefillExperts {
 public:
  // `decoder` and `backend` must outlive this. INVALID_ARGUMENT for slots <= 0 or
  // full_span_tokens <= 0; the backend's allocation errors.
  static absl::StatusOr<std::unique_ptr<PrefillExperts>> Create(const ReleaseExpertDecoder& decoder,
                                                                kernels::Backend& backend, int64_t num_experts,
                                                                PrefillExpertsOptions options);
  ~PrefillExperts();

  // A layer-major prefill of `span_tokens` starts: prefetch the first MoE layer.
  void Begin(int64_t span_tokens);
  // Model::LayerMajorOptions::before_moe. The slots stay valid until the next call or End.
  absl::StatusOr<std::optional<model::Model::PrefillLayerSlots>> BeforeMoe(int64_t layer,
                                                                          std::span<const model::MoeRouting> chunks);
  // The prefill stopped (done, failed or cancelled).
  void End();

  // Experts of a layer loaded for a span of `span_tokens` (the budget above).
  int64_t Budget(int64_t span_tokens) const;
  // Totals over every prefill so far (the nq_worker_prefill_* metrics count the same).
  const PrefillExpertStats& totals() const { return totals_; }
  int64_t slot_bytes() const { return slot_bytes_; }

 private:
  struct Buffer {
    int64_t layer = -1;
    std::vector<std::byte> host;     // slots x slot_bytes, filled by reads
    kernels::Tensor device;          // U8 [slots x slot_bytes] on the backend: what NqMoe reads
    std::vector<int32_t> expert_in;  // expert held by each slot, -1 none
  };
  PrefillExperts(const ReleaseExpertDecoder& decoder, kernels::Backend& backend, int64_t num_experts,
                 PrefillExpertsOptions options, int64_t slot_bytes);
  // Reads `experts` of `layer` into `b`'s slots (replacing what it held).
  absl::Status Prefetch(Buffer& b, int64_t layer, std::vector<int32_t> experts);
  // Reads one record into slot `slot` of `b`.
  absl::Status ReadInto(Buffer& b, int64_t layer, int32_t expert, int64_t slot);
  // The next MoE layer after `layer` the release holds, or -1.
  int64_t NextMoeLayer(int64_t layer) const;
  void StartPrefetch(int64_t layer);
  absl::Status WaitPrefetch();

  const ReleaseExpertDecoder& decoder_;
  kernels::Backend& backend_;
  const int64_t num_experts_;
  const PrefillExpertsOptions options_;
  const int64_t slot_bytes_;
  Buffer buffers_[2];
  int current_ = 0;  // the buffer BeforeMoe hands out; the other one is prefetched
  std::future<absl::Status> prefetch_;
  int64_t span_tokens_ = 0;
  PrefillExpertStats totals_;
  metrics::Counter& calls_4bit_;
  metrics::Counter& calls_2bit_;
  metrics::Counter& prefill_calls_4bit_;
  metrics::Counter& prefill_calls_2bit_;
  metrics::Counter& records_prefetched_;
  metrics::Counter& records_late_;
  metrics::Counter& records_from_slots_;
};

}  // namespace nq::release
