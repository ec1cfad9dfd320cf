// Layer-major prefill (issue #23): a long span runs layer by layer over its chunks, so one
// layer's routed experts can be held at 4 bits for the whole span (the hook before each MoE
// layer) while the next layer's are prefetched.
//
// Why the logits equal token-order chunked prefill's: at layer L, chunk c's attention reads the
// keys of positions < start + (c + 1) * C of layer L's cache, which chunks 0..c wrote at layer L
// (in this order) before it runs; its input is the output of layer L - 1 for the same tokens.
// Both orders therefore feed every (layer, chunk) computation the same tensors. A DSA layer
// that shares the selection of the last full layer gets that layer's selection for the same
// chunk (kept per chunk here; token order keeps one for the chunk in flight).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"

namespace nq::model {
namespace {

using kernels::Shape;
using kernels::Tensor;

// The routing of consecutive chunks as one routing of all their tokens, in order.
MoeRouting Concatenate(std::span<const MoeRouting> chunks) {
  MoeRouting all;
  for (const MoeRouting& r : chunks) {
    all.top_k = r.top_k;
    all.num_tokens += r.num_tokens;
    all.experts.insert(all.experts.end(), r.experts.begin(), r.experts.end());
    all.weights.insert(all.weights.end(), r.weights.begin(), r.weights.end());
    all.input_sq_norms.insert(all.input_sq_norms.end(), r.input_sq_norms.begin(), r.input_sq_norms.end());
  }
  return all;
}

}  // namespace

absl::StatusOr<std::vector<float>> Model::PrefillLayerMajor(std::span<const int32_t> tokens,
                                                            const LayerMajorOptions& options) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t start = cache_.length(), D = config_.hidden_size, C = options.chunk_tokens;
  if (T == 0) return absl::InvalidArgumentError("PrefillLayerMajor: no tokens");
  MailboxForwardBegins();
  if (C <= 0) return absl::InvalidArgumentError(absl::StrCat("PrefillLayerMajor: chunk_tokens ", C, " is not positive"));
  if (start + T > cache_.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: ", start, " cached + ", T,
                                                   " new tokens exceed the cache of ", cache_.max_tokens()));
  }
  // A loan of the rows past the span (its own expert slots, LendKvRoom) is what this prefill is
  // for; rows of the span itself must not be lent.
  RETURN_IF_ERROR(cache_.CheckWritable(start, T, "PrefillLayerMajor"));
  const int64_t num_chunks = (T + C - 1) / C;
  auto chunk_length = [&](int64_t c) { return std::min(C, T - c * C); };
  auto check_cancelled = [&]() -> absl::Status {
    if (options.cancelled && options.cancelled()) {
      return absl::CancelledError(absl::StrCat("prefill of ", T, " tokens cancelled"));
    }
    return absl::OkStatus();
  };

  // The residual stream of every chunk, kept across layers.
  std::vector<Tensor> xs(static_cast<size_t>(num_chunks));
  for (int64_t c = 0; c < num_chunks; ++c) {
    ASSIGN_OR_RETURN(xs[c], backend_.Allocate(kernels::DType::kF32, Shape{chunk_length(c), D}));
    RETURN_IF_ERROR(backend_.Embedding(tokens.subspan(static_cast<size_t>(c * C), static_cast<size_t>(chunk_length(c))),
                                       weights_.embed, xs[c]));
  }
  // Each chunk's DSA selection of the last full indexer layer (what token order keeps in
  // selection_ while the chunk runs through the stack).
  std::vector<std::optional<Tensor>> selections(static_cast<size_t>(num_chunks));
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    for (int64_t c = 0; c < num_chunks; ++c) {
      RETURN_IF_ERROR(check_cancelled());
      selection_ = std::move(selections[c]);
      const absl::Status attention = AttentionBlock(w, layer, static_cast<size_t>(layer), xs[c], start + c * C);
      selections[c] = std::move(selection_);
      selection_.reset();
      RETURN_IF_ERROR(attention);
    }
    if (!w.moe.has_value()) {
      for (int64_t c = 0; c < num_chunks; ++c) {
        RETURN_IF_ERROR(check_cancelled());
        RETURN_IF_ERROR(FfnBlock(w, layer, xs[c], nullptr, nullptr));
      }
      continue;
    }
    // Every chunk's routing first: the hook sees which experts the whole span uses.
    std::vector<MoeRouting> routings(static_cast<size_t>(num_chunks));
    for (int64_t c = 0; c < num_chunks; ++c) {
      ASSIGN_OR_RETURN(routings[c], RouteLayer(w, xs[c]));
    }
    if (ObservesRouting(layer)) routing_observer_(layer, Concatenate(routings));
    std::optional<PrefillLayerSlots> slots;
    if (options.before_moe) {
      ASSIGN_OR_RETURN(slots, options.before_moe(layer, routings));
    }
    for (int64_t c = 0; c < num_chunks; ++c) {
      RETURN_IF_ERROR(check_cancelled());
      RETURN_IF_ERROR(FfnBlock(w, layer, xs[c], &routings[c], slots.has_value() ? &*slots : nullptr));
    }
  }

  std::vector<float> hidden;
  hidden.reserve(static_cast<size_t>(T * D));
  for (int64_t c = 0; c < num_chunks; ++c) {
    RETURN_IF_ERROR(backend_.RmsNorm(xs[c], weights_.final_norm, static_cast<float>(config_.rms_norm_eps), xs[c]));
    ASSIGN_OR_RETURN(std::vector<float> part, kernels::DownloadFloats(backend_, xs[c]));
    hidden.insert(hidden.end(), part.begin(), part.end());
  }
  const Tensor& last_chunk = xs.back();
  const int32_t last = static_cast<int32_t>(chunk_length(num_chunks - 1) - 1);
  ASSIGN_OR_RETURN(Tensor row, backend_.Allocate(kernels::DType::kF32, Shape{1, D}));
  RETURN_IF_ERROR(backend_.GatherRows(last_chunk, std::span<const int32_t>(&last, 1), row));
  ASSIGN_OR_RETURN(std::vector<float> logits, Logits(row, weights_.lm_head));
  last_hidden_ = std::move(hidden);
  cache_.set_length(start + T);
  return logits;
}

absl::StatusOr<KvLoan> Model::LendKvRoom(int64_t from_token, int64_t record_bytes, int64_t max_records) {
  // The MTP layers' caches are cache layers too: their live rows end at mtp_length_.
  if (from_token < mtp_length_) {
    return absl::FailedPreconditionError(absl::StrCat("KV cache: the MTP cache's rows below ", mtp_length_,
                                                      " are live; a loan from row ", from_token,
                                                      " would overlap them"));
  }
  return cache_.Lend(from_token, record_bytes, max_records);
}

}  // namespace nq::model
