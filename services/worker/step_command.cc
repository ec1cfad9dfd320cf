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
};
static_assert(sizeof(WireHeader) <= kStepCommandHeaderBytes);

}  // namespace

std::vector<std::byte> EncodeStepHeader(const StepCommand& command) {
  const WireHeader wire{kHeaderMagic, static_cast<uint32_t>(command.op), command.position, command.sequence,
                        command.step, command.tokens.size()};
  std::vector<std::byte> out(kStepCommandHeaderBytes);
  std::memcpy(out.data(), &wire, sizeof(wire));
  return out;
}

std::vector<std::byte> EncodeStepPayload(const StepCommand& command) {
  std::vector<std::byte> out(command.tokens.size() * sizeof(int32_t));
  if (!out.empty()) std::memcpy(out.data(), command.tokens.data(), out.size());
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
      wire.op > static_cast<uint32_t>(StepCommand::Op::kResetCache)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown step command op ", wire.op));
  }
  if (wire.num_tokens > static_cast<uint64_t>(max_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("step command of ", wire.num_tokens, " tokens; this rank's context holds ", max_tokens));
  }
  StepCommand command;
  command.op = static_cast<StepCommand::Op>(wire.op);
  command.position = wire.position;
  command.sequence = wire.sequence;
  command.step = wire.step;
  command.tokens.resize(wire.num_tokens);
  return command;
}

absl::Status DecodeStepPayload(std::span<const std::byte> payload, StepCommand& command) {
  if (payload.size() != command.tokens.size() * sizeof(int32_t)) {
    return absl::InvalidArgumentError(absl::StrCat("step command payload of ", payload.size(), " bytes for ",
                                                   command.tokens.size(), " tokens"));
  }
  if (!payload.empty()) std::memcpy(command.tokens.data(), payload.data(), payload.size());
  return absl::OkStatus();
}

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
  }
  return absl::InvalidArgumentError("unknown step command");
}

}  // namespace nq::worker
