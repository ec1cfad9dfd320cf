// What the leader rank tells the other ranks of its tensor-parallel group before each model
// operation of a sequence (DESIGN.md section 3: "Leader has the next input token(s)"): the
// follower ranks run the same operation on their shard, so every collective inside it pairs up.
// Only the leader samples (the logits are all-gathered, so it holds them whole), so a command
// carries tokens and cache positions, never sampling state: the followers need none. The one
// draw a follower makes itself is a greedy draft chained on the backend (kDraftOnDevice): an
// argmax of logits gathered alike on every rank, so every rank picks the same drafts.
//
// With dynamic experts a command also carries the slot-table updates the leader applied at this
// step boundary (the streamer sends a group's updates to rank 0 only,
// services/streamer/group_sessions.h): every rank applies them before running the command, so
// every rank switches an expert between 2 and 4 bits at the same step (`step` names it) and the
// group's output is what one rank with those tables would compute.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"
#include "services/model/model.h"

namespace nq::worker {

struct StepCommand {
  enum class Op : uint32_t {
    kForward = 1,        // Model::Forward(tokens) at cache position `position`
    kForwardLast = 2,    // Model::ForwardLast(tokens) at cache position `position`
    kTruncateCache = 3,  // Model::TruncateCache(position)
    kResetCache = 4,     // Model::ResetCache()
    // Speculative decoding's drafter (MtpDrafter): the MTP layer is sharded like the others, so
    // its forwards are collectives too.
    kTruncateMtpCache = 5,  // Model::TruncateMtpCache(position)
    kForwardMtpLast = 6,    // Model::ForwardMtpLast(tokens, hidden rows named by hidden_row) at MTP
                            // cache position `position`
    kDraftOnDevice = 7,     // Model::DraftOnDevice(tokens, hidden rows, num_drafts, greedy) at MTP
                            // cache position `position`: the whole greedy drafting chain at once
  };
  // kForwardMtpLast: where the hidden states come from, as every rank holds them after the same
  // forwards: >= 0, rows [hidden_row, hidden_row + tokens) of Model::last_hidden() (the main
  // model's last forward); kLastMtpHidden, the last row of Model::last_mtp_hidden() (the
  // previous draft's state).
  static constexpr int64_t kLastMtpHidden = -1;
  Op op = Op::kResetCache;
  // kForward*: the cache length the forward starts at (a follower whose cache differs has
  // drifted and must not run it); kTruncateCache: the length to keep.
  int64_t position = 0;
  uint64_t sequence = 0;  // the leader's sequence counter (logs and checks)
  uint64_t step = 0;      // the sequence's decode step (0: prefill)
  int64_t hidden_row = 0;  // kForwardMtpLast and kDraftOnDevice (rows of last_hidden() only)
  int32_t num_drafts = 0;  // kDraftOnDevice only: 1 to kMaxCommandDrafts
  std::vector<int32_t> tokens;
  // Applied by every rank before the command runs, in order (SlotRuntime::BeginRelayedStep).
  std::vector<nq::v1::SlotTableUpdate> slot_updates;
  // Set by DecodeStepHeader: the bytes of slot updates its payload holds after the tokens.
  uint64_t slot_update_bytes = 0;
};

// Drafts one kDraftOnDevice may ask for (Model::DraftsOnDevice takes at most kMaxStepGraphTokens).
inline constexpr int32_t kMaxCommandDrafts = 64;

// A command's slot updates are a few KB (a change is a few bytes; an update holds a refresh's
// loads); a header announcing more than this is not one of ours.
inline constexpr uint64_t kMaxSlotUpdateBytes = uint64_t{64} << 20;

// The fixed-size header every command starts with; a follower waits for it between requests.
inline constexpr size_t kStepCommandHeaderBytes = 64;

// Header bytes, then the payload (the tokens, then the slot updates) of `command`.
std::vector<std::byte> EncodeStepHeader(const StepCommand& command);
std::vector<std::byte> EncodeStepPayload(const StepCommand& command);
// The command a header describes, tokens sized but not filled (and slot_update_bytes set);
// INVALID_ARGUMENT for a header that is not one (another build's layout, an unknown op, a token
// count past `max_tokens`, slot updates past kMaxSlotUpdateBytes, a draft count out of range).
absl::StatusOr<StepCommand> DecodeStepHeader(std::span<const std::byte> header, int64_t max_tokens);
// The payload bytes that follow the header of `command` (0: no payload round).
inline uint64_t StepPayloadBytes(const StepCommand& command) {
  return command.tokens.size() * sizeof(int32_t) + command.slot_update_bytes;
}
// Fills command.tokens and command.slot_updates from the payload bytes (EncodeStepPayload's).
// INVALID_ARGUMENT for a payload of another size or an update that does not parse.
absl::Status DecodeStepPayload(std::span<const std::byte> payload, StepCommand& command);

// Runs `command` on a follower's model. FAILED_PRECONDITION when the model's cache is not where
// the leader's was (the ranks have drifted apart).
absl::Status ApplyStepCommand(const StepCommand& command, model::Model& model);

// Where the leader sends each command before running it itself (the tensor-parallel group).
class StepMirror {
 public:
  virtual ~StepMirror() = default;
  virtual absl::Status Mirror(const StepCommand& command) = 0;
};

}  // namespace nq::worker
