// Wires issue #23's prefill into a worker from its flags: the chunk size and layer-major
// threshold of the sequence runner, and (serving a release with streaming) the 4-bit routed
// experts a layer-major prefill loads for itself (prefill_experts.h).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/model/model.h"
#include "services/release/release_expert_decoder.h"
#include "services/release/prefill_experts.h"
#include "services/worker/worker_service.h"

namespace nq::worker {

struct PrefillFlags {
  int64_t chunk_tokens = 2048;            // --prefill_chunk_tokens
  int64_t layer_major_min_tokens = 2048;  // --layer_major_prefill_tokens (0: off)
  // --prefill_expert_slots: the layer-major prefill's own slots for 4-bit experts (device memory
  // it holds for the worker's life); -1: every routed expert of a layer; 0: none of its own.
  // Borrowed slots come on top (borrow_kv).
  int64_t expert_slots = -1;
  // --prefill_borrow_kv: a layer-major prefill borrows slots from the free KV cache past its span
  // (up to every routed expert of a layer beyond its own slots), returned when it ends. With
  // expert_slots 0 and no borrowing, a layer-major prefill runs at the decode precision.
  bool borrow_kv = true;
  int64_t full_span_tokens = 32768;  // --prefill_full_span_tokens (PrefillExpertsOptions)
  double late_read_share = 0.25;     // --prefill_late_read_share (PrefillExpertsOptions)
};

// INVALID_ARGUMENT naming the flag for a bad chunk size, layer-major threshold, full span, late
// read share or slot count.
absl::Status ValidatePrefillFlags(const PrefillFlags& flags);

// A worker's 4-bit experts for layer-major prefills of `model` served from `decoder`'s release
// (flags validated; null with layer-major off, or with neither own slots nor any the cache could
// lend): records read through the streamer's io_uring store, or with pread and a warning where
// it cannot open; experts READY in `slots` (may be null) join without a read. The most it
// borrows is what the cache lends past the shortest layer-major span. The backend's allocation
// errors.
absl::StatusOr<std::unique_ptr<release::PrefillExperts>> CreatePrefillExperts(
    const model::Model& model, const release::ReleaseExpertDecoder& decoder, const SlotRuntime* slots,
    kernels::Backend& backend, const PrefillFlags& flags);

// Sets `options`' layer-major hooks to `experts`' (Begin, BeforeMoe, End), as a serving worker's
// prefill runs them, borrowing from `model`'s free KV cache (the model the prefill runs; null:
// no borrowing); both must outlive the options.
void AttachPrefillExperts(release::PrefillExperts* experts, model::Model* model, PrefillOptions& options);

// The most slots a layer-major prefill of `model` can borrow (the room past a span of
// min_span_tokens at the cache's start, at most n_routed_experts - own_slots), for slots of
// slot_bytes.
int64_t MaxBorrowedSlots(const model::Model& model, int64_t slot_bytes, int64_t own_slots, int64_t min_span_tokens);

// Validates the flags (INVALID_ARGUMENT naming the flag) and configures `service`. With
// `decoder` (a release served with dynamic experts) and slots, returns the PrefillExperts the
// service's hooks use: keep it alive while the service serves. Null otherwise.
// `slots` (may be null): experts READY there join the prefill's 4-bit set without a read.
absl::StatusOr<std::unique_ptr<release::PrefillExperts>> ConfigurePrefill(WorkerService& service, model::Model* model,
                                                                          const release::ReleaseExpertDecoder* decoder,
                                                                          const SlotRuntime* slots,
                                                                          kernels::Backend& backend,
                                                                          const PrefillFlags& flags);

}  // namespace nq::worker
