#include "services/tools/release_experts.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/tensor_io.h"
#include "services/format/file_io.h"
#include "services/common/status_macros.h"
#include "services/quant/codec.h"
#include "services/tools/release_encoder.h"
#include "services/tools/release_expert_decoder.h"

namespace nq::tools {

absl::StatusOr<ExpertBits> ParseExpertBits(const std::string& text) {
  if (text == "2") return ExpertBits::k2Bit;
  if (text == "4") return ExpertBits::k4Bit;
  if (text == "fixed") return ExpertBits::kFixedSet;
  return absl::InvalidArgumentError("expert bits '" + text + "': want 2, 4 or fixed");
}

absl::Status ApplyReleaseExperts(const std::string& release_dir, const std::string& model_dir,
                                 const model::ModelConfig& config, model::TensorParallel tp, ExpertBits bits,
                                 kernels::Backend& backend, model::ModelWeights& weights) {
  ASSIGN_OR_RETURN(std::unique_ptr<ReleaseExpertDecoder> decoder,
                   ReleaseExpertDecoder::Open(release_dir, model_dir, config, tp));
  return ApplyReleaseExperts(*decoder, config, bits, backend, weights);
}

absl::Status ApplyReleaseExperts(const ReleaseExpertDecoder& decoder, const model::ModelConfig& config,
                                 ExpertBits bits, kernels::Backend& backend, model::ModelWeights& weights) {
  for (uint32_t layer : decoder.moe_layer_ids()) {
    const std::vector<uint32_t> fixed = decoder.FixedSet(layer);
    model::LayerWeights& lw = layer < config.num_hidden_layers
                                  ? weights.layers[layer]
                                  : weights.mtp[layer - config.num_hidden_layers].block;
    for (uint32_t e = 0; e < static_cast<uint32_t>(config.n_routed_experts); ++e) {
      const bool four = bits == ExpertBits::k4Bit ||
                        (bits == ExpertBits::kFixedSet && std::find(fixed.begin(), fixed.end(), e) != fixed.end());
      ASSIGN_OR_RETURN(lw.moe->experts[e],
                       decoder.Upload(layer, e, four ? quant::Precision::k4Bit : quant::Precision::k2Bit, {}, backend));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<model::Model>> LoadModelWithRelease(const std::string& model_dir,
                                                                   const std::string& release_dir, ExpertBits bits,
                                                                   kernels::Backend& backend,
                                                                   kernels::Communicator* comm,
                                                                   model::ModelOptions options) {
  ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(model::Checkpoint checkpoint, model::Checkpoint::Open(model_dir));
  ASSIGN_OR_RETURN(model::ModelWeights weights, model::LoadModelWeights(checkpoint, config, backend, options.tp));
  absl::Status applied = ApplyReleaseExperts(release_dir, model_dir, config, options.tp, bits, backend, weights);
  if (!applied.ok()) return Annotate(applied, "release " + release_dir);
  return model::Model::Create(std::move(config), std::move(weights), backend, comm, options);
}

absl::StatusOr<KlReport> MeasureReleaseKl(const std::string& model_dir, const std::string& release_dir,
                                          std::span<const int32_t> tokens, ExpertBits bits) {
  if (!format::Release::Open(release_dir).ok()) {
    RETURN_IF_ERROR(EncodeRelease(model_dir, release_dir, {}));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  const model::ModelOptions options{.max_tokens = static_cast<int64_t>(tokens.size())};
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> full, model::Model::Load(model_dir, *backend, nullptr, options));
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> quantized,
                   LoadModelWithRelease(model_dir, release_dir, bits, *backend, nullptr, options));
  ASSIGN_OR_RETURN(std::vector<float> p_logits, full->Forward(tokens));
  ASSIGN_OR_RETURN(std::vector<float> q_logits, quantized->Forward(tokens));
  const int64_t vocab = full->config().vocab_size, rows = static_cast<int64_t>(tokens.size());
  KlReport report;
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = p_logits.data() + r * vocab;
    const float* q = q_logits.data() + r * vocab;
    auto log_normaliser = [&](const float* l) {
      double mx = l[0];
      for (int64_t i = 1; i < vocab; ++i) mx = std::max(mx, static_cast<double>(l[i]));
      double z = 0;
      for (int64_t i = 0; i < vocab; ++i) z += std::exp(l[i] - mx);
      return mx + std::log(z);
    };
    const double lp = log_normaliser(p), lq = log_normaliser(q);
    double kl = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double log_p = p[i] - lp, log_q = q[i] - lq;
      kl += std::exp(log_p) * (log_p - log_q);
    }
    report.mean_kl += kl / static_cast<double>(rows);
    const int64_t argmax_p = std::max_element(p, p + vocab) - p, argmax_q = std::max_element(q, q + vocab) - q;
    report.top1_agreement += (argmax_p == argmax_q ? 1.0 : 0.0) / static_cast<double>(rows);
  }
  return report;
}

}  // namespace nq::tools
