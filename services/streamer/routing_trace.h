// An in-memory routing trace (which experts each decode token used at each MoE layer, and
// with what weight) and its binary file format. The predictor is judged offline by replaying
// traces (DESIGN.md section 7); workers report routing as nq.v1.RoutingReport batches, which
// AppendRoutingReport turns into trace tokens.
//
// File format (version 2, all integers and floats little-endian):
//   magic "NQRT" (4 bytes) | version u32 | num_layers u32 | experts_per_layer u32 |
//   top_k u32 | num_tokens u64 | flags u32 | num_sequences u64 |
//   sequence_starts u64[num_sequences] | layer_ids u32[num_layers] |
//   records: token-major, for each token and layer: experts u16[top_k], weights f32[top_k],
//            then input_sq_norm f32 when flags has kTraceHasNorms
// Nothing follows the last record. Version 1 files (no flags, no sequences, no norms: one
// sequence, norms unknown) are still read.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq::streamer {

inline constexpr char kTraceMagic[4] = {'N', 'Q', 'R', 'T'};
inline constexpr uint32_t kTraceVersion = 2;
inline constexpr uint32_t kTraceVersionNoSequences = 1;
// Version 2 flags.
inline constexpr uint32_t kTraceHasNorms = 1;
// Expert ids are stored as u16 (DeepSeek-V3 has 256 routed experts per layer).
inline constexpr uint32_t kMaxTraceExperts = 65535;

struct RoutingTrace {
  // Model layer id of each MoE layer in the trace; trace layer l is layer_ids[l].
  std::vector<uint32_t> layer_ids;
  uint32_t experts_per_layer = 0;
  // Routed experts per token per layer (8 for DeepSeek-V3); the same for every entry.
  uint32_t top_k = 0;
  // Token-major: entry (t, l) holds top_k ids at experts[(t * num_layers + l) * top_k].
  std::vector<uint32_t> experts;
  std::vector<float> weights;
  // First token of each sequence (request), ascending, the first 0: the predictor resets its
  // per-request state there, as the streamer does at a new RoutingReport.sequence_id. Empty:
  // the whole trace is one sequence.
  std::vector<uint64_t> sequence_starts;
  // Per (token, layer) entry, the squared norm of the token's input to the layer
  // (LayerRouting.input_sq_norm); empty when not recorded.
  std::vector<float> input_sq_norms;

  uint32_t num_layers() const { return static_cast<uint32_t>(layer_ids.size()); }
  size_t num_tokens() const {
    const size_t per_token = static_cast<size_t>(num_layers()) * top_k;
    return per_token == 0 ? 0 : experts.size() / per_token;
  }
  // All layers of token t, layer-major: num_layers * top_k entries.
  std::span<const uint32_t> TokenExperts(size_t t) const {
    const size_t n = static_cast<size_t>(num_layers()) * top_k;
    return std::span<const uint32_t>(experts).subspan(t * n, n);
  }
  std::span<const float> TokenWeights(size_t t) const {
    const size_t n = static_cast<size_t>(num_layers()) * top_k;
    return std::span<const float>(weights).subspan(t * n, n);
  }
  // All layers of token t (num_layers entries), or an empty span without norms.
  std::span<const float> TokenNorms(size_t t) const {
    if (input_sq_norms.empty()) return {};
    return std::span<const float>(input_sq_norms).subspan(t * num_layers(), num_layers());
  }
  // The sequences as [begin, end) token ranges, in order (one range when sequence_starts is
  // empty).
  std::vector<std::pair<size_t, size_t>> Sequences() const;
};

// Checks shapes and ranges: sizes agree, every id < experts_per_layer, weights and norms
// finite (norms >= 0), sequence starts strictly ascending from 0 and below num_tokens.
absl::Status ValidateTrace(const RoutingTrace& trace);

// The file bytes of `trace` (validated first) and back. DecodeTrace's errors:
// INVALID_ARGUMENT "bad magic", UNIMPLEMENTED "unsupported trace version", DATA_LOSS
// "truncated" (with what was being read) or "trailing bytes", INVALID_ARGUMENT for bad
// contents (expert id out of range, ...).
absl::StatusOr<std::string> EncodeTrace(const RoutingTrace& trace);
absl::StatusOr<RoutingTrace> DecodeTrace(std::string_view bytes);

// Whole-file write (to path.tmp, then rename) and read; I/O errors carry the path.
absl::Status WriteTrace(const RoutingTrace& trace, const std::string& path);
absl::StatusOr<RoutingTrace> ReadTrace(const std::string& path);

// Appends the tokens of one worker report; a report whose sequence_id differs from the
// previous report's (`last_sequence_id`, updated) starts a new sequence. Norms are kept when
// every report so far carried them (an input_sq_norm of 0 counts as missing). An empty trace (no layers yet) takes its layer ids
// and top_k from the report; `experts_per_layer` must already be set (from the manifest).
// INVALID_ARGUMENT when the report disagrees with the trace (entry count, layer order,
// experts/weights sizes, id range); on error the trace is unchanged.
absl::Status AppendRoutingReport(const nq::v1::RoutingReport& report, RoutingTrace* trace,
                                 std::optional<uint64_t>* last_sequence_id = nullptr);

}  // namespace nq::streamer
