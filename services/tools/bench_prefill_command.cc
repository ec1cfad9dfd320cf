// nq bench-prefill: time to first token of long prompts on a model loaded as nq-worker loads it,
// with the worker's chunked and layer-major prefill and its 4-bit prefill experts read from the
// release (services/worker/prefill_bench.h says what is timed).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "services/release/prefill_experts.h"
#include "services/release/release_experts.h"
#include "services/tools/backend_flags.h"
#include "services/tools/commands.h"
#include "services/worker/prefill_bench.h"
#include "services/worker/prefill_setup.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, release);
ABSL_DECLARE_FLAG(std::string, expert_bits);
ABSL_DECLARE_FLAG(std::string, kv_cache_dtype);
ABSL_DECLARE_FLAG(std::string, weight_dtype);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int64_t, prefill_chunk_tokens);
ABSL_DECLARE_FLAG(int64_t, max_model_len);
ABSL_FLAG(std::string, prefill_lengths, "2048",
          "bench-prefill: comma-separated prompt lengths in tokens (the KV cache holds the longest and its first token)");
ABSL_FLAG(int, prefill_rounds, 2, "bench-prefill: requests per length (the first sizes its reads by length, later ones "
                                  "by the times measured)");
ABSL_FLAG(int64_t, layer_major_prefill_tokens, 2048,
          "bench-prefill: spans this long prefill layer-major with 4-bit experts read from --release (as nq-worker's "
          "flag; 0: token order at --expert_bits)");
ABSL_FLAG(int64_t, prefill_expert_slots, -1,
          "bench-prefill: the layer-major prefill's own slots for 4-bit experts (as nq-worker's flag; -1: every routed "
          "expert of a layer; 0: none of its own)");
ABSL_FLAG(bool, prefill_borrow_kv, true,
          "bench-prefill: borrow extra expert slots from the free KV cache past each span (as nq-worker's flag; the "
          "room is what --max_model_len leaves past the prompt)");
ABSL_FLAG(int64_t, prefill_full_span_tokens, 32768,
          "bench-prefill: spans this long hold every routed expert they use at 4 bits (as nq-worker's flag)");
ABSL_FLAG(double, prefill_late_read_share, 0.25,
          "bench-prefill: share of a layer's compute the reads its prefetch missed may add (as nq-worker's flag)");

namespace nq::tools {
namespace {

absl::StatusOr<std::vector<int64_t>> ParseLengths(const std::string& text) {
  std::vector<int64_t> lengths;
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t length = 0;
    if (!absl::SimpleAtoi(piece, &length) || length < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--prefill_lengths: '", piece, "' is not a positive token count"));
    }
    lengths.push_back(length);
  }
  if (lengths.empty()) return absl::InvalidArgumentError("--prefill_lengths: no length given");
  return lengths;
}

absl::Status BenchPrefill() {
  const std::string model_dir = absl::GetFlag(FLAGS_model), release_dir = absl::GetFlag(FLAGS_release);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  if (!std::filesystem::is_directory(model_dir)) {
    return absl::NotFoundError(absl::StrCat("--model ", model_dir, ": no such directory"));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> lengths, ParseLengths(absl::GetFlag(FLAGS_prefill_lengths)));
  worker::PrefillBenchOptions options{.prompt_tokens = lengths,
                                      .rounds = absl::GetFlag(FLAGS_prefill_rounds),
                                      .seed = absl::GetFlag(FLAGS_seed),
                                      .chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens),
                                      .layer_major_min_tokens = absl::GetFlag(FLAGS_layer_major_prefill_tokens)};
  // The context window: --max_model_len, or the longest prompt and its first token where that is
  // more. What lies past a prompt is the room a layer-major prefill can borrow slots from.
  if (absl::GetFlag(FLAGS_max_model_len) <= 0) return absl::InvalidArgumentError("--max_model_len must be positive");
  const int64_t context =
      std::max(*std::max_element(lengths.begin(), lengths.end()) + 1, absl::GetFlag(FLAGS_max_model_len));
  // Before the load, which takes minutes on a large model.
  if (absl::Status fits = worker::CheckPrefillBench(options, context); !fits.ok()) {
    return Annotate(fits, "--prefill_lengths, --prefill_rounds, --prefill_chunk_tokens, --layer_major_prefill_tokens");
  }
  // Past the model's positions its RoPE was never trained (the worker refuses such a
  // --max_model_len too).
  ASSIGN_OR_RETURN(const model::ModelConfig config, model::LoadModelConfig(model_dir));
  if (context > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("--prefill_lengths: a ", context - 1,
                                                   "-token prompt and its first token exceed the model's ",
                                                   config.max_position_embeddings, " positions"));
  }
  // The worker's prefill flags, checked as nq-worker checks them.
  const worker::PrefillFlags prefill_flags{.chunk_tokens = options.chunk_tokens,
                                           .layer_major_min_tokens = options.layer_major_min_tokens,
                                           .expert_slots = absl::GetFlag(FLAGS_prefill_expert_slots),
                                           .borrow_kv = absl::GetFlag(FLAGS_prefill_borrow_kv),
                                           .full_span_tokens = absl::GetFlag(FLAGS_prefill_full_span_tokens),
                                           .late_read_share = absl::GetFlag(FLAGS_prefill_late_read_share)};
  RETURN_IF_ERROR(worker::ValidatePrefillFlags(prefill_flags));
  const std::string bits_flag = absl::GetFlag(FLAGS_expert_bits);
  release::ExpertBits bits = release::ExpertBits::k2Bit;
  if (!release_dir.empty()) {
    ASSIGN_OR_RETURN(bits, release::ParseExpertBits(bits_flag));
    if (bits != release::ExpertBits::k2Bit && bits != release::ExpertBits::k4Bit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--expert_bits=", bits_flag, ": bench-prefill takes 2 (the streamed worker's bases, which a layer-major "
          "prefill raises to 4 bits) or 4 (every expert resident at 4 bits)"));
    }
  }
  options.token_order_share_4bit = bits == release::ExpertBits::k4Bit ? 1.0 : 0.0;
  ASSIGN_OR_RETURN(kernels::DType kv_dtype, model::ParseKvCacheDType(absl::GetFlag(FLAGS_kv_cache_dtype)));
  ASSIGN_OR_RETURN(kernels::DType weight_dtype, model::ParseWeightDType(absl::GetFlag(FLAGS_weight_dtype)));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, BackendFromFlags());

  model::ModelOptions model_options;
  model_options.max_tokens = context;
  model_options.kv_cache_dtype = kv_dtype;
  model_options.weight_dtype = weight_dtype;
  const auto started = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(release::ServedModel served,
                   release::LoadServedModel(model_dir, release_dir, bits, *backend, nullptr, model_options));
  model::Model& model = *served.model;
  std::fprintf(stderr, "nq bench-prefill: loaded %s in %.2f s on %s; KV cache %lld tokens\n", model_dir.c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
               backend->DeviceDescription().c_str(), static_cast<long long>(model.max_tokens()));

  // The worker's prefill experts: only for a release served at 2 bits, where a layer-major
  // prefill has something to raise.
  std::unique_ptr<release::PrefillExperts> experts;
  if (served.decoder != nullptr && bits == release::ExpertBits::k2Bit) {
    ASSIGN_OR_RETURN(experts, worker::CreatePrefillExperts(model, *served.decoder, /*slots=*/nullptr, *backend,
                                                           prefill_flags));
  }
  if (experts != nullptr) {
    std::fprintf(stderr, "nq bench-prefill: %lld own prefill slots and up to %lld borrowed from the KV cache, %.3f MiB each\n",
                 static_cast<long long>(experts->slots()), static_cast<long long>(experts->max_borrowed_slots()),
                 static_cast<double>(experts->slot_bytes()) / (1 << 20));
  } else if (options.layer_major_min_tokens > 0) {
    std::fprintf(stderr, "nq bench-prefill: layer-major spans run at --expert_bits (no 2-bit release to raise)\n");
  }
  ASSIGN_OR_RETURN(const std::vector<worker::PrefillBenchRow> rows,
                   worker::RunPrefillBench(model, experts.get(), options));
  std::fputs(worker::PrefillBenchTable(rows).c_str(), stdout);
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    nlohmann::ordered_json json{{"model", model_dir},
                                {"release", release_dir},
                                {"expert_bits", bits_flag},
                                {"backend", std::string(backend->name())},
                                {"device", backend->DeviceDescription()},
                                {"chunk_tokens", options.chunk_tokens},
                                {"layer_major_min_tokens", options.layer_major_min_tokens},
                                {"full_span_tokens", prefill_flags.full_span_tokens},
                                {"max_model_len", context},
                                {"prefill_expert_slots", prefill_flags.expert_slots},
                                {"prefill_borrow_kv", prefill_flags.borrow_kv},
                                {"rows", worker::PrefillBenchJson(rows)}};
    RETURN_IF_ERROR(format::WriteFileAtomic(out, json.dump(2) + "\n"));
    std::fprintf(stderr, "wrote %s\n", out.c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchPrefill(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return ReportCommandStatus("bench-prefill", absl::InvalidArgumentError("unexpected argument " + args[0]));
  }
  return ReportCommandStatus("bench-prefill", BenchPrefill());
}

}  // namespace nq::tools
