#include "services/eval/release_kl.h"

#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/eval/kl_divergence.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/release/release_encoder.h"

namespace nq::eval {

absl::StatusOr<KlReport> MeasureReleaseKl(const std::string& model_dir, const std::string& release_dir,
                                          std::span<const int32_t> tokens, release::ExpertBits bits) {
  if (!format::Release::Open(release_dir).ok()) {
    RETURN_IF_ERROR(release::EncodeRelease(model_dir, release_dir, {}));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  const model::ModelOptions options{.max_tokens = static_cast<int64_t>(tokens.size())};
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> full, model::Model::Load(model_dir, *backend, nullptr, options));
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> quantized,
                   release::LoadModelWithRelease(model_dir, release_dir, bits, *backend, nullptr, options));
  ASSIGN_OR_RETURN(std::vector<float> p_logits, full->Forward(tokens));
  ASSIGN_OR_RETURN(std::vector<float> q_logits, quantized->Forward(tokens));
  ASSIGN_OR_RETURN(std::vector<TokenKl> per_token, KlDivergenceRows(p_logits, q_logits, full->config().vocab_size));
  const KlSummary summary = SummarizeKl(per_token);
  return KlReport{.mean_kl = summary.mean, .top1_agreement = summary.top1_agreement};
}

}  // namespace nq::eval
