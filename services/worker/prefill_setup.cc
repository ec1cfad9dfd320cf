#include "services/worker/prefill_setup.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/worker/prefill_record_reader.h"

namespace nq::worker {

void AttachPrefillExperts(release::PrefillExperts* experts, PrefillOptions& options) {
  options.before_moe = [experts](int64_t layer, std::span<const model::MoeRouting> chunks) {
    return experts->BeforeMoe(layer, chunks);
  };
  options.begin_layer_major = [experts](int64_t span) { experts->Begin(span); };
  options.end_layer_major = [experts] { experts->End(); };
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
                                                   ": want -1 (every expert), 0 (none) or a slot count"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<release::PrefillExperts>> CreatePrefillExperts(
    const model::Model& model, const release::ReleaseExpertDecoder& decoder, const SlotRuntime* slots,
    kernels::Backend& backend, const PrefillFlags& flags) {
  RETURN_IF_ERROR(ValidatePrefillFlags(flags));
  if (flags.expert_slots == 0 || flags.layer_major_min_tokens == 0) return nullptr;
  const int64_t num_experts = model.config().n_routed_experts;
  release::PrefillExpertsOptions experts_options{
      .slots = std::min(flags.expert_slots < 0 ? num_experts : flags.expert_slots, num_experts),
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

absl::StatusOr<std::unique_ptr<release::PrefillExperts>> ConfigurePrefill(WorkerService& service, const model::Model* model,
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
    AttachPrefillExperts(experts.get(), options);
    spdlog::info("prefill: chunks of {} tokens; spans of {}+ tokens run layer-major with up to {} experts per layer at "
                 "4 bits (all they use from {} tokens on; {:.1f} MiB of prefill slots)",
                 flags.chunk_tokens, flags.layer_major_min_tokens, experts->slots(), flags.full_span_tokens,
                 2.0 * static_cast<double>(experts->slots() * experts->slot_bytes()) / (1 << 20));
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
