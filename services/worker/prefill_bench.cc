#include "services/worker/prefill_bench.h"

#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"
#include "services/worker/decode_bench.h"
#include "services/worker/prefill_setup.h"

namespace nq::worker {

absl::Status CheckPrefillBench(const PrefillBenchOptions& options, int64_t context_window) {
  if (options.prompt_tokens.empty()) return absl::InvalidArgumentError("prefill bench: no prompt lengths");
  if (options.rounds < 1) return absl::InvalidArgumentError(absl::StrCat("prefill bench: ", options.rounds, " rounds"));
  for (int64_t length : options.prompt_tokens) {
    if (length < 1) return absl::InvalidArgumentError(absl::StrCat("prefill bench: a prompt of ", length, " tokens"));
    // The worker's count: the prompt plus the token the prefill emits.
    if (length + 1 > context_window) {
      return absl::InvalidArgumentError(absl::StrCat("prefill bench: a ", length, "-token prompt and its first token "
                                                     "exceed the context window of ", context_window, " tokens"));
    }
  }
  return PrefillOptions{.chunk_tokens = options.chunk_tokens, .layer_major_min_tokens = options.layer_major_min_tokens}
      .Validate();
}

absl::StatusOr<std::vector<PrefillBenchRow>> RunPrefillBench(model::Model& model, release::PrefillExperts* experts,
                                                             const PrefillBenchOptions& options) {
  RETURN_IF_ERROR(CheckPrefillBench(options, model.max_tokens()));
  SequenceRunner runner(&model, /*eos_token_ids=*/{});
  PrefillOptions prefill{.chunk_tokens = options.chunk_tokens, .layer_major_min_tokens = options.layer_major_min_tokens};
  if (experts != nullptr) AttachPrefillExperts(experts, &model, prefill);
  RETURN_IF_ERROR(runner.SetPrefillOptions(std::move(prefill)));
  std::vector<PrefillBenchRow> rows;
  for (size_t length_index = 0; length_index < options.prompt_tokens.size(); ++length_index) {
    const int64_t length = options.prompt_tokens[length_index];
    for (int round = 1; round <= options.rounds; ++round) {
      runner.ForgetCache();
      SequenceRequest request;
      // A fresh prompt per request: nothing of the one before is reused.
      request.prompt = DecodeBenchPrompt(
          length, model.config().vocab_size,
          options.seed + 1000003ULL * (length_index * static_cast<uint64_t>(options.rounds) + round));
      request.max_tokens = 1;
      request.ignore_eos = true;
      const release::PrefillExpertStats before =
          experts != nullptr ? experts->totals() : release::PrefillExpertStats{};
      std::optional<double> first_token_seconds;
      const auto start = std::chrono::steady_clock::now();
      const absl::Status ran = runner
                                   .Run(request,
                                        [&](const SequenceStep&) {
                                          if (!first_token_seconds.has_value()) {
                                            first_token_seconds = std::chrono::duration<double>(
                                                                      std::chrono::steady_clock::now() - start)
                                                                      .count();
                                          }
                                          return true;
                                        },
                                        [] { return false; })
                                   .status();
      RETURN_IF_ERROR(ran);
      if (!first_token_seconds.has_value()) {
        return absl::InternalError(absl::StrCat("prefill bench: the ", length, "-token request emitted no token"));
      }
      PrefillBenchRow row{.prompt_tokens = length,
                          .round = round,
                          .layer_major = options.layer_major_min_tokens > 0 && length >= options.layer_major_min_tokens,
                          .seconds = *first_token_seconds};
      if (experts != nullptr && row.layer_major) {
        const release::PrefillExpertStats& after = experts->totals();
        row.calls_4bit = after.calls_4bit - before.calls_4bit;
        row.calls_2bit = after.calls_2bit - before.calls_2bit;
        row.records_prefetched_used = after.records_prefetched_used - before.records_prefetched_used;
        row.records_read_late = after.records_read_late - before.records_read_late;
        const release::PrefillTimings timings = experts->timings();
        row.read_bytes_per_second = timings.read_bytes_per_second;
        row.seconds_per_token_layer = timings.seconds_per_token_layer;
        const double calls = row.calls_4bit + row.calls_2bit;
        row.share_4bit = calls > 0 ? row.calls_4bit / calls : 0;
      } else {
        row.share_4bit = options.token_order_share_4bit;
      }
      rows.push_back(row);
    }
  }
  runner.ForgetCache();
  return rows;
}

std::string PrefillBenchTable(const std::vector<PrefillBenchRow>& rows) {
  std::string out = absl::StrFormat("%8s %5s %-11s %9s %9s %8s %10s %6s %10s\n", "tokens", "round", "prefill",
                                    "seconds", "tokens/s", "4-bit", "prefetched", "late", "read GB/s");
  for (const PrefillBenchRow& row : rows) {
    absl::StrAppendFormat(&out, "%8d %5d %-11s %9.3f %9.0f %8.3f %10d %6d %10.2f\n", row.prompt_tokens, row.round,
                          row.layer_major ? "layer-major" : "token-order", row.seconds, row.tokens_per_second(),
                          row.share_4bit, row.records_prefetched_used, row.records_read_late,
                          row.read_bytes_per_second / 1e9);
  }
  return out;
}

nlohmann::ordered_json PrefillBenchJson(const std::vector<PrefillBenchRow>& rows) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const PrefillBenchRow& row : rows) {
    out.push_back({{"prompt_tokens", row.prompt_tokens},
                   {"round", row.round},
                   {"prefill", row.layer_major ? "layer-major" : "token-order"},
                   {"seconds", row.seconds},
                   {"tokens_per_second", row.tokens_per_second()},
                   {"share_4bit", row.share_4bit},
                   {"calls_4bit", row.calls_4bit},
                   {"calls_2bit", row.calls_2bit},
                   {"records_prefetched_used", row.records_prefetched_used},
                   {"records_read_late", row.records_read_late},
                   {"read_bytes_per_second", row.read_bytes_per_second},
                   {"seconds_per_token_layer", row.seconds_per_token_layer}});
  }
  return out;
}

}  // namespace nq::worker
