// nq logits: float32 little-endian logits, one row of vocab_size per input token.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "services/common/status_macros.h"
#include "services/model/local_tp_group.h"
#include "services/release/release_experts.h"
#include "services/tools/commands.h"

ABSL_FLAG(std::string, model, "", "logits: HF checkpoint directory (config.json + safetensors)");
ABSL_FLAG(std::string, tokens, "", "logits: comma-separated input token ids");
ABSL_FLAG(std::string, release, "", "logits: take the routed experts from this NestQuant release");
ABSL_FLAG(std::string, expert_bits, "fixed", "logits, mtp-acceptance, bench-decode: with --release, 2, 4 or fixed");
ABSL_FLAG(int, tp, 1, "logits: tensor-parallel world size (ranks run as threads on the CPU backend)");
ABSL_FLAG(bool, decode, false, "logits: feed the tokens one at a time through the KV cache");
ABSL_FLAG(std::string, kv_cache_dtype, "f32",
          "logits, bench-decode: storage of the KV cache's latent and rope key, f32, bf16 or fp8 (E4M3 latent "
          "rows with a scale per 128 values, bf16 rope key); the indexer keys stay f32");
ABSL_FLAG(bool, mtp, false,
          "logits: write the MTP layer's logits instead (row i from token i+1 and the hidden state "
          "at i; one row fewer than tokens)");

namespace nq::tools {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id) || id < 0) {
      return absl::InvalidArgumentError("--tokens: '" + std::string(part) + "' is not a token id");
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("--tokens: no token ids");
  return ids;
}

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model), out = absl::GetFlag(FLAGS_out);
  if (model_dir.empty() || out.empty()) return absl::InvalidArgumentError("--model and --out are required");
  ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ParseTokens(absl::GetFlag(FLAGS_tokens)));
  const int tp = absl::GetFlag(FLAGS_tp);
  if (tp < 1) return absl::InvalidArgumentError("--tp must be at least 1");
  if (absl::GetFlag(FLAGS_mtp) && tokens.size() < 2) {
    return absl::InvalidArgumentError("--mtp needs at least 2 tokens");
  }
  absl::StatusOr<kernels::DType> kv_dtype = model::ParseKvCacheDType(absl::GetFlag(FLAGS_kv_cache_dtype));
  if (!kv_dtype.ok()) return Annotate(kv_dtype.status(), "--kv_cache_dtype");
  model::LocalTpGroup::RankLoader loader;
  if (const std::string release = absl::GetFlag(FLAGS_release); !release.empty()) {
    ASSIGN_OR_RETURN(release::ExpertBits bits, release::ParseExpertBits(absl::GetFlag(FLAGS_expert_bits)));
    loader = [model_dir, release, bits](kernels::Backend& backend, kernels::Communicator* comm,
                                        model::ModelOptions options) {
      return release::LoadModelWithRelease(model_dir, release, bits, backend, comm, options);
    };
  }
  ASSIGN_OR_RETURN(std::unique_ptr<model::LocalTpGroup> group,
                   model::LocalTpGroup::Load(model_dir, tp,
                                             {.max_tokens = static_cast<int64_t>(tokens.size()),
                                              .kv_cache_dtype = *kv_dtype},
                                             loader));
  std::vector<float> logits;
  if (absl::GetFlag(FLAGS_decode)) {
    std::vector<float> hidden;
    for (size_t i = 0; i < tokens.size(); ++i) {
      ASSIGN_OR_RETURN(std::vector<float> row, group->Forward(std::span<const int32_t>(&tokens[i], 1)));
      logits.insert(logits.end(), row.begin(), row.end());
      const std::vector<float>& h = group->rank0().last_hidden();
      hidden.insert(hidden.end(), h.begin(), h.end());
    }
    if (absl::GetFlag(FLAGS_mtp)) {
      logits.clear();
      const int64_t D = group->rank0().config().hidden_size;
      for (size_t i = 0; i + 1 < tokens.size(); ++i) {
        ASSIGN_OR_RETURN(std::vector<float> row,
                         group->ForwardMtp(std::span<const int32_t>(&tokens[i + 1], 1),
                                           std::span<const float>(hidden.data() + i * D, D)));
        logits.insert(logits.end(), row.begin(), row.end());
      }
    }
  } else {
    ASSIGN_OR_RETURN(logits, group->Forward(tokens));
    if (absl::GetFlag(FLAGS_mtp)) {
      const int64_t D = group->rank0().config().hidden_size;
      const std::vector<float> hidden = group->rank0().last_hidden();
      ASSIGN_OR_RETURN(logits, group->ForwardMtp(std::span<const int32_t>(tokens).subspan(1),
                                                 std::span<const float>(hidden).first((tokens.size() - 1) * D)));
    }
  }
  std::ofstream file(out, std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
  file.close();
  if (!file) return absl::InternalError("cannot write " + out);
  std::fprintf(stderr, "nq logits: wrote %zu rows x %lld to %s\n", logits.size() / group->rank0().config().vocab_size,
               static_cast<long long>(group->rank0().config().vocab_size), out.c_str());
  return absl::OkStatus();
}

}  // namespace

int RunLogits(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "nq logits: unexpected argument '%s'\n", args[0].c_str());
    return 2;
  }
  if (absl::Status s = Run(); !s.ok()) {
    std::fprintf(stderr, "nq logits: %s\n", s.ToString().c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace nq::tools
