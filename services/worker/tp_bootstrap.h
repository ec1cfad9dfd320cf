// What rank 0 hands every other rank of a newly formed tensor-parallel group before the first
// step, when the model's collectives run on another transport than the group's control channel
// (the shared-memory segment, services/worker/tp_leader.h): on CUDA, the NCCL unique id every rank
// passes to ncclCommInitRank. Rank 0 makes a new id for each group it forms (an id names one
// communicator; a re-formed group is a new one), so the id travels at every formation, in one
// BroadcastBytes round of the control channel right after the group is ready.
//
// A follower checks what arrives before it joins (CheckTpBootstrap): the same transport and world
// size, the same NCCL version (two NCCL builds may not share a communicator), and the checksum
// over the record (a torn or foreign record must not become an id). A mismatch is a refusal
// naming the field, like the identity check (tp_identity.h): waiting cannot cure it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/comm/nccl_communicator.h"
#include "kernels/comm/group_control.h"

namespace nq::worker {

enum class TpTransport : uint32_t { kSharedMemory = 1, kNccl = 2 };
absl::string_view TpTransportName(TpTransport transport);

struct TpBootstrap {
  TpTransport transport = TpTransport::kNccl;
  uint32_t world_size = 0;
  uint64_t generation = 0;    // the control group's generation (GroupControl::generation)
  int32_t nccl_version = 0;   // ncclGetVersion() of rank 0's library
  kernels::NcclUniqueId id{};  // opaque: ncclGetUniqueId's bytes
};

// magic, layout, transport, world size, NCCL version, generation, id, checksum.
inline constexpr size_t kTpBootstrapBytes = 8 + 4 + 4 + 4 + 4 + 8 + kernels::kNcclUniqueIdBytes + 8;

std::vector<std::byte> EncodeTpBootstrap(const TpBootstrap& bootstrap);
// INVALID_ARGUMENT for bytes that are not a bootstrap of this layout (size, magic, layout
// version, checksum), naming which.
absl::StatusOr<TpBootstrap> DecodeTpBootstrap(std::span<const std::byte> bytes);

// What this rank expects: FAILED_PRECONDITION naming the first field that differs
// ("world_size mismatch: rank 0 sent 4, this rank was started with 2").
struct TpBootstrapExpectation {
  TpTransport transport = TpTransport::kNccl;
  uint32_t world_size = 0;
  uint64_t generation = 0;
  int32_t nccl_version = 0;
};
absl::Status CheckTpBootstrap(const TpBootstrap& got, const TpBootstrapExpectation& want);

// Rank 0: sends `bootstrap` to every rank of `control` (a formed group).
absl::Status SendTpBootstrap(kernels::GroupControl& control, const TpBootstrap& bootstrap, absl::Duration timeout);
// Rank > 0: receives rank 0's bootstrap and checks it against `want` (the generation is the
// control group's). A record that fails to decode or check breaks the group with the reason
// (rank 0 then fails its join at once rather than after a timeout) and is FAILED_PRECONDITION.
absl::StatusOr<TpBootstrap> ReceiveTpBootstrap(kernels::GroupControl& control, TpBootstrapExpectation want,
                                               absl::Duration timeout);

}  // namespace nq::worker
