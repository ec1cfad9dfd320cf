// Disk faults injected into the record store's reads, for tests and drills of what the streamer
// does when a drive misbehaves (issue #22): a read that fails with EIO, or lands short. The
// store applies them to completions as the kernel returns them, before it judges them, so the
// real error paths run: the record is never copied into a slot, the expert stays at 2 bits, and
// the failure is counted by reason (nq_streamer_read_errors_total). Off unless configured.
//
//   --inject_read_faults=eio=0.05,short=0.02,seed=7   (a probability per record read)
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "absl/status/statusor.h"

namespace nq::streamer {

struct ReadFaults {
  double eio = 0;         // probability that a record read fails with EIO
  double short_read = 0;  // probability that a record read lands short (half of one piece)
  uint64_t seed = 1;
  bool any() const { return eio > 0 || short_read > 0; }
};

// "eio=P,short=P,seed=N" in any order, each optional; "" is no faults. INVALID_ARGUMENT naming
// the part that is not a key=value with a probability in [0, 1] (or an integer seed).
absl::StatusOr<ReadFaults> ParseReadFaults(const std::string& text);

// What happens to one record read.
enum class ReadFault { kNone, kIoError, kShortRead };

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
