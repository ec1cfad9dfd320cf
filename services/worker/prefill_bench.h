// nq bench-prefill (issue #23): how fast a long prompt prefills on a model loaded as nq-worker
// loads it, with no service in the way, and at what precision its routed experts ran.
//
// Each (length, round) runs one request of `length` fresh token ids (drawn from the seed, the
// round and the length, so no prompt shares a prefix with the one before and the cache is
// forgotten between them) through the worker's SequenceRunner with the worker's prefill options:
// chunks of chunk_tokens, and a span of layer_major_min_tokens or more layer-major with the
// prefill's own 4-bit experts (release::PrefillExperts) when they are given. The request asks for
// one token, so the time is the time to first token without the network: every chunk's forward,
// the records read for the 4-bit experts (through the streamer's io_uring store, as the worker
// reads them), their uploads, and the first token's selection.
//
// The first layer-major prefill of a PrefillExperts sizes its reads by the span's length; later
// ones by the times it measured (prefill_experts.h), so round 1 and round 2 can differ, as a
// worker's first and later long prompts do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "services/model/model.h"
#include "services/release/prefill_experts.h"
#include "services/worker/sequence_runner.h"

namespace nq::worker {

struct PrefillBenchOptions {
  std::vector<int64_t> prompt_tokens;  // each length, in this order
  int rounds = 2;                      // requests per length
  uint64_t seed = 0;
  int64_t chunk_tokens = 2048;            // PrefillOptions::chunk_tokens
  int64_t layer_major_min_tokens = 2048;  // PrefillOptions::layer_major_min_tokens (0: token order)
  // The 4-bit share of a token-order prefill's expert calls: what the model was loaded with
  // (0 at 2 bits, 1 at 4 bits), since token order runs every expert at that precision.
  double token_order_share_4bit = 0;
};

struct PrefillBenchRow {
  int64_t prompt_tokens = 0;
  int round = 0;  // 1-based
  bool layer_major = false;
  double seconds = 0;  // from the request to its first token
  // Layer-major with 4-bit experts: the routed (token x expert) calls of the decoder's MoE
  // layers by precision, and how their records arrived (deltas of this request).
  double calls_4bit = 0;
  double calls_2bit = 0;
  int64_t records_prefetched_used = 0;
  int64_t records_read_late = 0;
  // PrefillExperts' measured averages after this request (0 before any measurement).
  double read_bytes_per_second = 0;
  double seconds_per_token_layer = 0;
  double share_4bit = 0;
  double tokens_per_second() const { return seconds > 0 ? static_cast<double>(prompt_tokens) / seconds : 0; }
};

// INVALID_ARGUMENT for no lengths, a length < 1, a length that leaves no room for the first
// token in `context_window`, rounds < 1, or bad prefill options.
absl::Status CheckPrefillBench(const PrefillBenchOptions& options, int64_t context_window);

// Runs the requests on `model`; `experts` (may be null: layer-major spans then run at the
// model's loaded precision) must have been created for it. Errors of the runner and the reads.
absl::StatusOr<std::vector<PrefillBenchRow>> RunPrefillBench(model::Model& model, release::PrefillExperts* experts,
                                                             const PrefillBenchOptions& options);

// A table for people, one line per row, and the rows as JSON.
std::string PrefillBenchTable(const std::vector<PrefillBenchRow>& rows);
nlohmann::ordered_json PrefillBenchJson(const std::vector<PrefillBenchRow>& rows);

}  // namespace nq::worker
