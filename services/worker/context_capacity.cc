#include "services/worker/context_capacity.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace nq::worker {

ContextCapacity MeasureContextCapacity(const model::Model& model, uint64_t free_bytes) {
  ContextCapacity c;
  c.allocated_tokens = model.max_tokens();
  // The cache is linear in its tokens (every layer's rows have a fixed width).
  c.bytes_per_token = c.allocated_tokens > 0 ? model.kv_cache_bytes() / c.allocated_tokens : 0;
  c.model_limit_tokens = model.config().max_position_embeddings;
  c.free_bytes = free_bytes;
  const double usable = static_cast<double>(free_bytes) * (1.0 - kContextHeadroom);
  const int64_t more = c.bytes_per_token > 0 ? static_cast<int64_t>(usable / static_cast<double>(c.bytes_per_token)) : 0;
  c.fit_tokens = std::max(c.allocated_tokens, std::min(c.allocated_tokens + more, c.model_limit_tokens));
  return c;
}

absl::StatusOr<std::optional<int64_t>> ParseMaxModelLen(absl::string_view text) {
  if (text == "auto") return std::optional<int64_t>();
  int64_t tokens = 0;
  if (!absl::SimpleAtoi(text, &tokens) || tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_model_len must be a positive number of tokens or auto, got '", text, "'"));
  }
  return std::optional<int64_t>(tokens);
}

absl::StatusOr<int64_t> AutoMaxModelLen(uint64_t free_bytes, uint64_t other_bytes, uint64_t kv_bytes_per_token,
                                        int64_t model_limit_tokens, const std::string& device) {
  if (kv_bytes_per_token == 0 || model_limit_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_model_len=auto needs the KV cache's bytes per token (",
                                                   kv_bytes_per_token, ") and the model's limit (",
                                                   model_limit_tokens, ")"));
  }
  const double rest = free_bytes > other_bytes ? static_cast<double>(free_bytes - other_bytes) : 0.0;
  const double fit = rest * (1.0 - kContextHeadroom) / static_cast<double>(kv_bytes_per_token);
  int64_t tokens = std::min<int64_t>(model_limit_tokens, static_cast<int64_t>(fit));
  if (tokens < model_limit_tokens) tokens -= tokens % kAutoContextGranule;
  if (tokens < kMinAutoContextTokens) {
    constexpr double kGiB = 1 << 30;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "--max_model_len=auto: %s has %.2f GiB free; the model without its KV cache needs %.2f GiB, which leaves "
        "room for %d tokens at %d bytes a token (at least %d wanted); free memory, use --kv_cache_dtype fp8 or "
        "bf16, or give --max_model_len a number",
        device, static_cast<double>(free_bytes) / kGiB, static_cast<double>(other_bytes) / kGiB,
        std::max<int64_t>(tokens, 0), kv_bytes_per_token, kMinAutoContextTokens));
  }
  return tokens;
}

absl::StatusOr<uint64_t> HostAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    uint64_t kib = 0;
    if (fields >> kib) return kib * 1024;
  }
  return absl::UnavailableError("no MemAvailable in /proc/meminfo");
}

void ReportContextCapacity(const ContextCapacity& c, const std::string& device, metrics::Registry& registry) {
  spdlog::info("context: the KV cache holds {} tokens (--max_model_len; {} bytes a token); {:.2f} GiB free on {} "
               "would hold {} tokens (with {:.0f}% headroom); the model's limit is {}",
               c.allocated_tokens, c.bytes_per_token, static_cast<double>(c.free_bytes) / (1 << 30), device,
               c.fit_tokens, kContextHeadroom * 100, c.model_limit_tokens);
  auto& gauge = registry.Gauge("nq_worker_context_tokens",
                               "Tokens of context: the KV cache allocated, what the free memory would hold, and the "
                               "model's limit",
                               {"kind"});
  gauge.WithLabels({"allocated"}).Set(static_cast<double>(c.allocated_tokens));
  gauge.WithLabels({"fit"}).Set(static_cast<double>(c.fit_tokens));
  gauge.WithLabels({"model_limit"}).Set(static_cast<double>(c.model_limit_tokens));
}

}  // namespace nq::worker
