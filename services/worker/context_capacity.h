// How many tokens of context a worker can hold (issue #23): the KV cache --max_model_len
// allocated, and how far the memory still free after loading would stretch it, up to the
// model's limit. Stated at start in the log and as nq_worker_context_tokens{kind}.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/common/metrics/registry.h"
#include "services/model/model.h"

namespace nq::worker {

// Share of the free memory left for activations, the prefill chunk's and the prefill experts'
// buffers when estimating what would fit: the KV cache may not take all of it.
inline constexpr double kContextHeadroom = 0.10;

struct ContextCapacity {
  int64_t allocated_tokens = 0;  // the KV cache allocated now (--max_model_len)
  int64_t bytes_per_token = 0;   // of the KV cache, every layer (MTP included)
  int64_t fit_tokens = 0;        // what allocated + 90% of the free memory would hold, capped at the model's limit
  int64_t model_limit_tokens = 0;  // max_position_embeddings
  uint64_t free_bytes = 0;
};

// From the loaded model and the memory free on its device after loading.
ContextCapacity MeasureContextCapacity(const model::Model& model, uint64_t free_bytes);

// --max_model_len: a positive token count, or "auto" (nullopt): as many tokens as the memory
// free before loading holds (AutoMaxModelLen). INVALID_ARGUMENT otherwise.
absl::StatusOr<std::optional<int64_t>> ParseMaxModelLen(absl::string_view text);

// The fewest tokens "auto" settles for: below this the worker refuses to start rather than serve
// prompts too short to be useful.
inline constexpr int64_t kMinAutoContextTokens = 1024;

// --max_model_len=auto, before anything is loaded: the KV cache gets what `free_bytes` leaves
// after everything else the worker will hold (`other_bytes`: weights, routed experts, slot
// arena, workspace), less kContextHeadroom of that rest, at `kv_bytes_per_token`, capped at the
// model's limit and rounded down to a multiple of kAutoContextGranule (so that a few MiB more or
// less free give the same context). RESOURCE_EXHAUSTED naming the bytes when fewer than
// kMinAutoContextTokens fit; INVALID_ARGUMENT for a zero per-token size or limit.
inline constexpr int64_t kAutoContextGranule = 256;
absl::StatusOr<int64_t> AutoMaxModelLen(uint64_t free_bytes, uint64_t other_bytes, uint64_t kv_bytes_per_token,
                                        int64_t model_limit_tokens, const std::string& device);

// MemAvailable of /proc/meminfo (the CPU backend's memory). UNAVAILABLE when unreadable.
absl::StatusOr<uint64_t> HostAvailableBytes();

// Logs the capacity (one line, naming `device`) and sets nq_worker_context_tokens{kind}
// (allocated, fit, model_limit).
void ReportContextCapacity(const ContextCapacity& capacity, const std::string& device, metrics::Registry& registry);

}  // namespace nq::worker
