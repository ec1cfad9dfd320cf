#include "services/worker/prefill_setup.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/worker/prefill_record_reader.h"

namespace nq::worker {

void AttachPrefillExperts(release::PrefillExperts* experts, model::Model* model, PrefillOptions& options) {
  options.before_moe = [experts](int64_t layer, std::span<const model::MoeRouting> chunks) {
    return experts->BeforeMoe(layer, chunks);
  };
  // The runner calls begin at the cache's end, before the span's prefill, and end right after it
  // (done, failed or cancelled), before any other forward: the loan never outlives the prefill.
  options.begin_layer_major = [experts, model](int64_t span) { experts->Begin(span, model); };
  options.end_layer_major = [experts] { experts->End(); };
}

int64_t MaxBorrowedSlots(const model::Model& model, int64_t slot_bytes, int64_t own_slots, int64_t min_span_tokens) {
  // A layer-major span is at least min_span_tokens long and starts at row 0 or later, so the
  // room past it is largest for the shortest span on an empty cache.
  const int64_t wanted = std::max<int64_t>(model.config().n_routed_experts - own_slots, 0);
  if (wanted == 0 || min_span_tokens > model.max_tokens()) return 0;
  return model.LendableKvRecords(min_span_tokens, slot_bytes, wanted);
}

absl::Status ValidatePrefillFlags(const PrefillFlags& flags) {
  RETURN_IF_ERROR(
      (PrefillOptions{.chunk_tokens = flags.chunk_tokens, .layer_major_min_tokens = flags.layer_major_min_tokens})
          .Validate());
  if (flags.full_span_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill_full_span_tokens=", flags.full_span_tokens, ": want a positive span length"));
  }
  if (!(flags.late_read_share >= 0 && flags.late_read_share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--prefill_late_read_share=", flags.late_read_share,
                                                   ": want a share of a layer's compute in [0, 1]"));
  }
  if (flags.expert_slots < -1) {
    return absl::InvalidArgumentError(absl::StrCat("--prefill_expert_slots=", flags.expert_slots,
                                                   ": want -1 (every expert), 0 (none of its own: borrowed slots "
                                                   "only, with --prefill_borrow_kv) or a slot count"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<release::PrefillExperts>> CreatePrefillExperts(
    const model::Model& model, const release::ReleaseExpertDecoder& decoder, const SlotRuntime* slots,
    kernels::Backend& backend, const PrefillFlags& flags) {
  RETURN_IF_ERROR(ValidatePrefillFlags(flags));
  if (flags.layer_major_min_tokens == 0 || (flags.expert_slots == 0 && !flags.borrow_kv)) return nullptr;
  const int64_t num_experts = model.config().n_routed_experts;
  const int64_t own = std::min(flags.expert_slots < 0 ? num_experts : flags.expert_slots, num_experts);
  ASSIGN_OR_RETURN(const release::ReleaseExpertDecoder::SlotNeeds needs, decoder.Needs());
  const int64_t max_borrowed =
      flags.borrow_kv ? MaxBorrowedSlots(model, static_cast<int64_t>(needs.rec_bytes), own, flags.layer_major_min_tokens)
                      : 0;
  if (own == 0 && max_borrowed == 0) {
    spdlog::warn("prefill: --prefill_expert_slots=0 and the KV cache of {} tokens lends no slot of {} bytes past a "
                 "{}-token span (--max_model_len): layer-major prefill runs at the decode precision",
                 model.max_tokens(), needs.rec_bytes, flags.layer_major_min_tokens);
    return nullptr;
  }
  release::PrefillExpertsOptions experts_options{.slots = own,
                                                 .max_borrowed_slots = max_borrowed,
                                                 .full_span_tokens = flags.full_span_tokens,
                                                 .decoder_layers = model.config().num_hidden_layers,
                                                 .late_read_share = flags.late_read_share};
  // Records through the streamer's io_uring store; one pread after another where it cannot
  // open (no io_uring in a container's seccomp profile, say): slower, as correct.
  absl::StatusOr<std::unique_ptr<RecordStorePrefillReader>> reader =
      RecordStorePrefillReader::Open(decoder.release().dir(), decoder.rank());
  if (reader.ok()) {
    experts_options.reader = *std::move(reader);
  } else {
    spdlog::warn("prefill: records read with pread, one after another ({})", reader.status().ToString());
  }
  if (slots != nullptr) {
    // The prefill runs inside one slot step, so the READY slots it copies stay put.
    experts_options.copy_ready = [slots](int64_t layer, int32_t expert, std::span<std::byte> out) {
      return slots->CopyReadyResidual(layer, expert, out);
    };
  }
  return release::PrefillExperts::Create(decoder, backend, num_experts, experts_options);
}

absl::StatusOr<std::unique_ptr<release::PrefillExperts>> ConfigurePrefill(WorkerService& service, model::Model* model,
                                                                          const release::ReleaseExpertDecoder* decoder,
                                                                          const SlotRuntime* slots,
                                                                          kernels::Backend& backend,
                                                                          const PrefillFlags& flags) {
  // Checked here too, with or without a model: a bad value is refused, never ignored.
  RETURN_IF_ERROR(ValidatePrefillFlags(flags));
  PrefillOptions options{.chunk_tokens = flags.chunk_tokens, .layer_major_min_tokens = flags.layer_major_min_tokens};
  std::unique_ptr<release::PrefillExperts> experts;
  if (model != nullptr && decoder != nullptr) {
    ASSIGN_OR_RETURN(experts, CreatePrefillExperts(*model, *decoder, slots, backend, flags));
  }
  if (experts != nullptr) {
    AttachPrefillExperts(experts.get(), model, options);
    const double mib = static_cast<double>(experts->slot_bytes()) / (1 << 20);
    spdlog::info("prefill: chunks of {} tokens; spans of {}+ tokens run layer-major with up to {} experts per layer at "
                 "4 bits (all they use from {} tokens on; {} own slots, {:.1f} MiB on the backend, and {:.1f} MiB of "
                 "host staging)",
                 flags.chunk_tokens, flags.layer_major_min_tokens, experts->slots() + experts->max_borrowed_slots(),
                 flags.full_span_tokens, experts->slots(), static_cast<double>(experts->slots()) * mib,
                 2.0 * static_cast<double>(experts->slots() + experts->max_borrowed_slots()) * mib);
    if (flags.borrow_kv) {
      // The most room a prefill can borrow: past the shortest layer-major span on an empty cache;
      // a span later in the context, or a longer one, leaves less.
      spdlog::info("prefill: slot borrowing from the free KV cache: up to {} slots ({:.1f} MiB) past a {}-token span "
                   "of a {}-token cache, fewer as the context fills; returned when each prefill ends",
                   experts->max_borrowed_slots(), static_cast<double>(experts->max_borrowed_slots()) * mib,
                   flags.layer_major_min_tokens, model->max_tokens());
    }
  } else {
    spdlog::info("prefill: chunks of {} tokens; layer-major {}", flags.chunk_tokens,
                 flags.layer_major_min_tokens > 0
                     ? absl::StrCat("for spans of ", flags.layer_major_min_tokens,
                                    "+ tokens, at the decode precision (no release streamed, or no prefill slots)")
                     : std::string("off"));
  }
  RETURN_IF_ERROR(service.SetPrefillOptions(std::move(options)));
  return experts;
}

}  // namespace nq::worker
