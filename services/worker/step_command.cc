#include "services/worker/step_command.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

constexpr uint32_t kHeaderMagic = 0x4e515354;  // "NQST"

// The header's wire layout (host byte order: every rank runs on one host, or one build).
struct WireHeader {
  uint32_t magic;
  uint32_t op;
  int64_t position;
  uint64_t sequence;
  uint64_t step;
  uint64_t num_tokens;
  uint64_t update_bytes;  // slot updates after the tokens: [u32 size, serialized update]...
  int64_t hidden_row;
  int32_t num_drafts;
  uint32_t reserved;
};
static_assert(sizeof(WireHeader) <= kStepCommandHeaderBytes);

// Each update as its length (u32) and its protobuf bytes.
std::string EncodeSlotUpdates(const std::vector<nq::v1::SlotTableUpdate>& updates) {
  std::string out;
  for (const nq::v1::SlotTableUpdate& update : updates) {
    const std::string bytes = update.SerializeAsString();
    const uint32_t size = static_cast<uint32_t>(bytes.size());
    out.append(reinterpret_cast<const char*>(&size), sizeof(size));
    out.append(bytes);
  }
  return out;
}

uint64_t SlotUpdateBytes(const std::vector<nq::v1::SlotTableUpdate>& updates) {
  uint64_t bytes = 0;
  for (const nq::v1::SlotTableUpdate& update : updates) bytes += sizeof(uint32_t) + update.ByteSizeLong();
  return bytes;
}

}  // namespace

std::vector<std::byte> EncodeStepHeader(const StepCommand& command) {
  const WireHeader wire{.magic = kHeaderMagic,
                        .op = static_cast<uint32_t>(command.op),
                        .position = command.position,
                        .sequence = command.sequence,
                        .step = command.step,
                        .num_tokens = command.tokens.size(),
                        .update_bytes = SlotUpdateBytes(command.slot_updates),
                        .hidden_row = command.hidden_row,
                        .num_drafts = command.num_drafts,
                        .reserved = 0};
  std::vector<std::byte> out(kStepCommandHeaderBytes);
  std::memcpy(out.data(), &wire, sizeof(wire));
  return out;
}

std::vector<std::byte> EncodeStepPayload(const StepCommand& command) {
  const size_t token_bytes = command.tokens.size() * sizeof(int32_t);
  const std::string updates = EncodeSlotUpdates(command.slot_updates);
  std::vector<std::byte> out(token_bytes + updates.size());
  if (token_bytes > 0) std::memcpy(out.data(), command.tokens.data(), token_bytes);
  if (!updates.empty()) std::memcpy(out.data() + token_bytes, updates.data(), updates.size());
  return out;
}

absl::StatusOr<StepCommand> DecodeStepHeader(std::span<const std::byte> header, int64_t max_tokens) {
  if (header.size() != kStepCommandHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("step command header of ", header.size(), " bytes"));
  }
  WireHeader wire;
  std::memcpy(&wire, header.data(), sizeof(wire));
  if (wire.magic != kHeaderMagic) return absl::InvalidArgumentError("not a step command header");
  if (wire.op < static_cast<uint32_t>(StepCommand::Op::kForward) ||
      wire.op > static_cast<uint32_t>(StepCommand::Op::kDraftOnDevice)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown step command op ", wire.op));
  }
  if (wire.num_tokens > static_cast<uint64_t>(max_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("step command of ", wire.num_tokens, " tokens; this rank's context holds ", max_tokens));
  }
  if (wire.update_bytes > kMaxSlotUpdateBytes) {
    return absl::InvalidArgumentError(absl::StrCat("step command with ", wire.update_bytes,
                                                   " bytes of slot updates; at most ", kMaxSlotUpdateBytes));
  }
  if (wire.op == static_cast<uint32_t>(StepCommand::Op::kDraftOnDevice) &&
      (wire.num_drafts < 1 || wire.num_drafts > kMaxCommandDrafts || wire.hidden_row < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("step command drafting ", wire.num_drafts,
                                                   " tokens from hidden row ", wire.hidden_row, " (1 to ",
                                                   kMaxCommandDrafts, " drafts from a row of the last forward)"));
  }
  StepCommand command;
  command.op = static_cast<StepCommand::Op>(wire.op);
  command.position = wire.position;
  command.sequence = wire.sequence;
  command.step = wire.step;
  command.hidden_row = wire.hidden_row;
  command.num_drafts = wire.num_drafts;
  command.tokens.resize(wire.num_tokens);
  command.slot_update_bytes = wire.update_bytes;
  return command;
}

absl::Status DecodeStepPayload(std::span<const std::byte> payload, StepCommand& command) {
  const size_t token_bytes = command.tokens.size() * sizeof(int32_t);
  if (payload.size() != StepPayloadBytes(command)) {
    return absl::InvalidArgumentError(absl::StrCat("step command payload of ", payload.size(), " bytes for ",
                                                   command.tokens.size(), " tokens and ", command.slot_update_bytes,
                                                   " bytes of slot updates"));
  }
  if (token_bytes > 0) std::memcpy(command.tokens.data(), payload.data(), token_bytes);
  command.slot_updates.clear();
  for (size_t at = token_bytes; at < payload.size();) {
    uint32_t size = 0;
    if (payload.size() - at < sizeof(size)) {
      return absl::InvalidArgumentError(absl::StrCat("step command: a slot update's size cut off at byte ", at));
    }
    std::memcpy(&size, payload.data() + at, sizeof(size));
    at += sizeof(size);
    if (payload.size() - at < size) {
      return absl::InvalidArgumentError(
          absl::StrCat("step command: a slot update of ", size, " bytes with ", payload.size() - at, " left"));
    }
    if (!command.slot_updates.emplace_back().ParseFromArray(payload.data() + at, static_cast<int>(size))) {
      return absl::InvalidArgumentError(absl::StrCat("step command: slot update ", command.slot_updates.size(),
                                                     " does not parse"));
    }
    at += size;
  }
  return absl::OkStatus();
}

namespace {

// kForwardMtpLast and kDraftOnDevice on a follower: the hidden rows the leader used, from this
// rank's own copy (the final-normed states are whole on every rank after the last all-reduce).
absl::StatusOr<std::vector<float>> MtpHiddenRows(const StepCommand& command, const model::Model& model) {
  if (model.mtp_cache_length() != command.position) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", command.sequence, " step ", command.step,
                                                      ": this rank's MTP cache holds ", model.mtp_cache_length(),
                                                      " positions, the leader's ", command.position));
  }
  const size_t D = static_cast<size_t>(model.config().hidden_size);
  const size_t T = command.tokens.size();
  std::vector<float> hidden;
  if (command.hidden_row == StepCommand::kLastMtpHidden) {
    const std::vector<float>& state = model.last_mtp_hidden();
    if (state.size() < D || T != 1) {
      return absl::FailedPreconditionError(absl::StrCat("step ", command.step, ": a draft forward of ", T,
                                                        " tokens from an MTP state of ", state.size(), " values"));
    }
    hidden.assign(state.end() - static_cast<std::ptrdiff_t>(D), state.end());
  } else {
    const std::vector<float>& state = model.last_hidden();
    if (command.hidden_row < 0 || (static_cast<size_t>(command.hidden_row) + T) * D > state.size()) {
      return absl::FailedPreconditionError(absl::StrCat("step ", command.step, ": hidden rows [", command.hidden_row,
                                                        ", +", T, ") past the ", state.size() / D,
                                                        " rows of this rank's last forward"));
    }
    const auto first = state.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(command.hidden_row) * D);
    hidden.assign(first, first + static_cast<std::ptrdiff_t>(T * D));
  }
  return hidden;
}

}  // namespace

absl::Status ApplyStepCommand(const StepCommand& command, model::Model& model) {
  switch (command.op) {
    case StepCommand::Op::kForward:
    case StepCommand::Op::kForwardLast: {
      if (model.cache_length() != command.position) {
        return absl::FailedPreconditionError(absl::StrCat("sequence ", command.sequence, " step ", command.step,
                                                          ": this rank's cache holds ", model.cache_length(),
                                                          " tokens, the leader's ", command.position));
      }
      // The logits are the leader's to sample; a follower's copy is dropped.
      absl::StatusOr<std::vector<float>> logits = command.op == StepCommand::Op::kForward
                                                      ? model.Forward(command.tokens)
                                                      : model.ForwardLast(command.tokens);
      return logits.status();
    }
    case StepCommand::Op::kTruncateCache:
      return model.TruncateCache(command.position);
    case StepCommand::Op::kResetCache:
      model.ResetCache();
      return absl::OkStatus();
    case StepCommand::Op::kTruncateMtpCache:
      return model.TruncateMtpCache(command.position);
    case StepCommand::Op::kForwardMtpLast: {
      ASSIGN_OR_RETURN(const std::vector<float> hidden, MtpHiddenRows(command, model));
      return model.ForwardMtpLast(command.tokens, hidden).status();
    }
    case StepCommand::Op::kDraftOnDevice: {
      ASSIGN_OR_RETURN(const std::vector<float> hidden, MtpHiddenRows(command, model));
      // Greedy: the leader's draw differs at most in fields a greedy draw ignores.
      return model.DraftOnDevice(command.tokens, hidden, command.num_drafts, kernels::SampleParams{}).status();
    }
  }
  return absl::InvalidArgumentError("unknown step command");
}

}  // namespace nq::worker
