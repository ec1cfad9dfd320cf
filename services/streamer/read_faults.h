// Disk faults injected into the record store's reads, for tests and drills of what the streamer
// does when a drive misbehaves (issue #22): a read that fails with EIO, lands short, or takes
// seconds. The store applies EIO and short reads to completions as the kernel returns them,
// before it judges them, so the real error paths run: the record is never copied into a slot,
// the expert stays at 2 bits, and the failure is counted by reason
// (nq_streamer_read_errors_total). A slow read really holds its record in the ring: with the
// record's pieces goes a timer (IORING_OP_TIMEOUT) of the given length, and the record lands
// only when both are done, occupying its place under the queue depth meanwhile as a stalled
// drive's read would (nq_streamer_read_faults_injected_total{kind="slow"}, and
// nq_streamer_slow_reads_total for every read that took a second or more). Off unless configured.
//
//   --inject_read_faults=eio=0.05,short=0.02,slow=0.1:2000,seed=7
//   (a probability per record read; slow=P:MS, a read taking at least MS milliseconds)
//   --inject_read_faults=eio=0.5,rank=1
//   (only reads of rank 1's records fail: a tensor-parallel group where one rank's drive is bad)
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "absl/status/statusor.h"

namespace nq::streamer {

struct ReadFaults {
  double eio = 0;         // probability that a record read fails with EIO
  double short_read = 0;  // probability that a record read lands short (half of one piece)
  double slow = 0;        // probability that a record read takes at least slow_ms
  uint32_t slow_ms = 0;
  uint64_t seed = 1;
  // Only reads of this rank's records draw faults (rank=R); every rank's when unset.
  std::optional<uint32_t> rank;
  bool any() const { return eio > 0 || short_read > 0 || slow > 0; }
};

// Longest injected slow read: a minute is a drive that has stopped answering; anything longer
// is a typo, not a drill.
inline constexpr uint32_t kMaxSlowReadMs = 60'000;

// "eio=P,short=P,slow=P:MS,seed=N,rank=R" in any order, each optional; "" is no faults.
// INVALID_ARGUMENT naming the part that is not a key=value with a probability in [0, 1] (the
// three together at most 1), an integer seed or rank, or a slow read's MS in [1, kMaxSlowReadMs].
absl::StatusOr<ReadFaults> ParseReadFaults(const std::string& text);

// What happens to one record read.
enum class ReadFault { kNone, kIoError, kShortRead, kSlow };

// Draws a fault per record read (deterministic for a seed). Not thread-safe: one per store.
class ReadFaultInjector {
 public:
  explicit ReadFaultInjector(ReadFaults faults) : faults_(faults), rng_(faults.seed) {}
  ReadFault Next();

 private:
  ReadFaults faults_;
  std::mt19937_64 rng_;
};

}  // namespace nq::streamer
