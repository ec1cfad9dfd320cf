// An in-memory routing trace (which experts each decode token used at each MoE layer, and
// with what weight) and its binary file format. The predictor is judged offline by replaying
// traces (DESIGN.md section 7); workers report routing as nq.v1.RoutingReport batches, which
// AppendRoutingReport turns into trace tokens.
//
// File format (version 1, all integers and floats little-endian):
//   magic "NQRT" (4 bytes) | version u32 | num_layers u32 | experts_per_layer u32 |
//   top_k u32 | num_tokens u64 | layer_ids u32[num_layers] |
//   records: token-major, for each token and layer: experts u16[top_k], weights f32[top_k]
// Nothing follows the last record.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq::streamer {

inline constexpr char kTraceMagic[4] = {'N', 'Q', 'R', 'T'};
inline constexpr uint32_t kTraceVersion = 1;
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
};

// Checks shapes and ranges: sizes agree, every id < experts_per_layer, weights finite.
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

// Appends the tokens of one worker report. An empty trace (no layers yet) takes its layer ids
// and top_k from the report; `experts_per_layer` must already be set (from the manifest).
// INVALID_ARGUMENT when the report disagrees with the trace (entry count, layer order,
// experts/weights sizes, id range); on error the trace is unchanged.
absl::Status AppendRoutingReport(const nq::v1::RoutingReport& report, RoutingTrace* trace);

}  // namespace nq::streamer
