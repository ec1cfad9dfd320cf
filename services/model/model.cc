#include "services/model/model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/grow_capacity.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/model/moe_routing.h"

namespace nq::model {
namespace {

using kernels::Shape;
using kernels::Tensor;

// HF builds q_a_layernorm, kv_a_layernorm and the indexer's k_norm without passing the
// config's eps, so they use 1e-6 in both architectures (docs/model_math.md section 4).
constexpr float kLatentNormEps = 1e-6f;
constexpr int64_t kDefaultMaxTokens = 4096;

std::vector<float> FloatInvFreq(const ModelConfig& config) {
  std::vector<double> inv = config.RopeInvFreq();
  return std::vector<float>(inv.begin(), inv.end());
}

// GLM's attention and indexer always rotate interleaved pairs in transformers 5.17 (and its
// configs say so); DeepSeek-V3 follows rope_interleave (default true).
bool MlaRopeInterleaved(const ModelConfig& c) {
  return c.architecture == Architecture::kGlmMoeDsa ? true : c.rope_interleave;
}
MoeRoutingParams RoutingParams(const ModelConfig& c) {
  return {.num_experts = static_cast<int>(c.n_routed_experts),
          .top_k = static_cast<int>(c.num_experts_per_tok),
          .n_group = static_cast<int>(c.n_group),
          .topk_group = static_cast<int>(c.topk_group),
          .norm_topk_prob = c.norm_topk_prob,
          .routed_scaling_factor = static_cast<float>(c.routed_scaling_factor)};
}

bool IndexerRopeInterleaved(const ModelConfig& c) {
  return c.architecture == Architecture::kGlmMoeDsa ? true : c.indexer.rope_interleave;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& model_dir, kernels::Backend& backend,
                                                   kernels::Communicator* comm, ModelOptions options) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  // Its routed experts are packed E2M1 with no dense loader here; say where they are served
  // rather than fail on the first U8 tensor.
  if (config.quantization.has_value() && config.quantization->method == QuantMethod::kModeloptNvfp4) {
    return absl::FailedPreconditionError(absl::StrCat(
        model_dir, " is an NVFP4 checkpoint: its routed experts are served packed by release::LoadServedModel "
                   "(nq-worker, nq bench-decode, nq kld --nvfp4), or expand it with nq nvfp4 dequantize"));
  }
  ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(model_dir));
  absl::StatusOr<ModelWeights> weights =
      LoadModelWeights(checkpoint, config, backend, options.tp, {.matrix_dtype = options.weight_dtype});
  if (!weights.ok()) return Annotate(weights.status(), absl::StrCat("loading ", model_dir));
  return Create(std::move(config), *std::move(weights), backend, comm, options);
}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(ModelConfig config, ModelWeights weights,
                                                     kernels::Backend& backend, kernels::Communicator* comm,
                                                     ModelOptions options) {
  if (options.tp.world_size > 1 &&
      (comm == nullptr || comm->world_size() != options.tp.world_size || comm->rank() != options.tp.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallelism over ", options.tp.world_size,
                                                   " ranks needs a communicator of that world for rank ",
                                                   options.tp.rank));
  }
  if (options.max_tokens <= 0) {
    options.max_tokens = std::min<int64_t>(config.max_position_embeddings, kDefaultMaxTokens);
  }
  // Every MoE layer runs its routed experts dense, packed (NestQuant) or NVFP4; packed layers get
  // the slot table their NqMoe reads (NVFP4 experts are all resident: no slots).
  std::map<int64_t, Tensor> slot_tables;
  auto check_moe = [&](const LayerWeights& lw, int64_t layer) -> absl::Status {
    if (!lw.moe.has_value()) return absl::OkStatus();
    const int64_t E = config.n_routed_experts;
    if (lw.moe->nvfp4.has_value()) {
      if (lw.moe->packed.has_value() || lw.moe->nvfp4->weights.num_experts != E) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": NVFP4 experts hold ",
                                                       lw.moe->nvfp4->weights.num_experts, " experts, the config ", E,
                                                       lw.moe->packed.has_value() ? ", and packed ones too" : ""));
      }
    } else if (lw.moe->packed.has_value()) {
      const PackedExperts& p = *lw.moe->packed;
      if (p.weights.num_experts != E || (!p.static_slots.empty() && static_cast<int64_t>(p.static_slots.size()) != E)) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": packed experts hold ", p.weights.num_experts,
                                                       " experts, the config ", E));
      }
      ASSIGN_OR_RETURN(slot_tables[layer], backend.Allocate(kernels::DType::kI32, Shape{E}));
    } else if (static_cast<int64_t>(lw.moe->experts.size()) != E) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": ", lw.moe->experts.size(), " routed experts of ",
                                                     E, " loaded and none packed (serve a release, or load them)"));
    }
    return absl::OkStatus();
  };
  for (size_t l = 0; l < weights.layers.size(); ++l) RETURN_IF_ERROR(check_moe(weights.layers[l], static_cast<int64_t>(l)));
  for (size_t i = 0; i < weights.mtp.size(); ++i) {
    RETURN_IF_ERROR(check_moe(weights.mtp[i].block, config.num_hidden_layers + static_cast<int64_t>(i)));
  }
  // Cache layers for the decoder and the MTP layers actually loaded.
  std::vector<bool> cache_layers = KvCacheIndexerLayers(config);
  cache_layers.resize(static_cast<size_t>(config.num_hidden_layers) + weights.mtp.size());
  ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(backend, config, cache_layers, options.max_tokens,
                                                  options.kv_cache_dtype));
  std::unique_ptr<Model> model(new Model(std::move(config), std::move(weights), backend, comm, std::move(cache), options));
  model->slot_tables_ = std::move(slot_tables);
  return model;
}

int64_t Model::RoutedExpertBytes() const {
  int64_t bytes = 0;
  auto add = [&](const LayerWeights& lw) {
    if (!lw.moe.has_value()) return;
    if (lw.moe->packed.has_value()) {
      bytes += lw.moe->packed->packed_bytes + static_cast<int64_t>(lw.moe->packed->records.nbytes());
    }
    if (lw.moe->nvfp4.has_value()) bytes += lw.moe->nvfp4->bytes;
    for (const MlpWeights& e : lw.moe->experts) bytes += static_cast<int64_t>(e.gate_up.nbytes() + e.down.nbytes());
  };
  for (const LayerWeights& lw : weights_.layers) add(lw);
  for (const MtpWeights& m : weights_.mtp) add(m.block);
  return bytes;
}

Model::Model(ModelConfig config, ModelWeights weights, kernels::Backend& backend, kernels::Communicator* comm,
             KvCache cache, ModelOptions options)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      backend_(backend),
      comm_(comm),
      cache_(std::move(cache)),
      options_(options),
      inv_freq_(FloatInvFreq(config_)),
      attention_scaling_(static_cast<float>(config_.AttentionScaling())),
      softmax_scale_(static_cast<float>(config_.SoftmaxScale())) {}

void Model::ResetCache() {
  cache_.set_length(0);
  mtp_length_ = 0;
}

absl::Status Model::TruncateCache(int64_t length) {
  if (length < 0 || length > cache_.length()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot truncate a cache of ", cache_.length(),
                                                   " tokens to ", length));
  }
  cache_.set_length(length);
  mtp_length_ = std::min(mtp_length_, length);
  return absl::OkStatus();
}

absl::Status Model::TruncateMtpCache(int64_t length) {
  if (length < 0 || length > mtp_length_) {
    return absl::InvalidArgumentError(absl::StrCat("cannot truncate an MTP cache of ", mtp_length_,
                                                   " entries to ", length));
  }
  mtp_length_ = length;
  return absl::OkStatus();
}

absl::Status Model::AllReduce(Tensor& t) {
  if (options_.tp.world_size == 1) return absl::OkStatus();
  return comm_->AllReduceSum(t);
}

absl::StatusOr<Tensor> Model::Zeros(Shape shape) {
  std::vector<float> zeros(static_cast<size_t>(shape.NumElements()), 0.0f);
  return kernels::UploadFloats(backend_, zeros, kernels::DType::kF32, std::move(shape));
}

absl::Status Model::RunStack(std::span<const int32_t> tokens, Tensor& x) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t start = cache_.length();
  if (T == 0) return absl::InvalidArgumentError("Forward: no tokens");
  if (start + T > cache_.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: ", start, " cached + ", T,
                                                   " new tokens exceed the cache of ", cache_.max_tokens()));
  }
  RETURN_IF_ERROR(cache_.CheckWritable(start, T, "Forward"));
  RETURN_IF_ERROR(RefreshSlotTables());
  RETURN_IF_ERROR(BeginRoutingLog(T));
  ASSIGN_OR_RETURN(x, backend_.Allocate(kernels::DType::kF32, Shape{T, config_.hidden_size}));
  RETURN_IF_ERROR(backend_.Embedding(tokens, weights_.embed, x));
  selection_.reset();
  // Each layer's last residual is added by the next norm, unless a lookahead router reads x
  // between layers.
  PendingResidual residual;
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    RETURN_IF_ERROR(RunLayer(weights_.layers[layer], layer, static_cast<size_t>(layer), x, start,
                             lookahead_observer_ ? nullptr : &residual));
    if (!lookahead_observer_) continue;
    if (lookahead_layer_ran_) lookahead_layer_ran_(layer);
    if (const int64_t target = layer + lookahead_depth_;
        lookahead_depth_ >= 1 && target < config_.num_hidden_layers && config_.IsMoeLayer(target)) {
      ASSIGN_OR_RETURN(const MoeRouting predicted, RouteLayer(weights_.layers[target], x));
      lookahead_observer_(target, predicted);
    }
    // The loads the observer asks for may land while this forward runs: the next MoE layer
    // applies the slot mailbox again, so a residual posted by now serves the layers after L (the
    // observer already keeps this forward off step graphs and on the host).
    if (mailbox_.has_value()) mailbox_->apply_due = true;
  }
  RETURN_IF_ERROR(NormWithResidual(x, residual, weights_.final_norm, x));
  ASSIGN_OR_RETURN(last_hidden_, kernels::DownloadFloats(backend_, x));
  FlushRoutingLog();  // the download waited for the backend: the routing copies have landed
  cache_.set_length(start + T);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Model::Forward(std::span<const int32_t> tokens) {
  if (StepGraphApplies(tokens.size())) return GraphedForward(tokens);
  Tensor x;
  RETURN_IF_ERROR(RunStack(tokens, x));
  return Logits(x, weights_.lm_head);
}

absl::StatusOr<std::vector<float>> Model::ForwardLast(std::span<const int32_t> tokens) {
  if (StepGraphApplies(tokens.size())) {
    // The graph computes every token's logits (a GEMV reads the head once for up to 4 rows).
    ASSIGN_OR_RETURN(std::vector<float> all, GraphedForward(tokens));
    const size_t vocab = all.size() / tokens.size();
    all.erase(all.begin(), all.end() - static_cast<std::ptrdiff_t>(vocab));
    return all;
  }
  Tensor x;
  RETURN_IF_ERROR(RunStack(tokens, x));
  const int32_t last = static_cast<int32_t>(tokens.size() - 1);
  ASSIGN_OR_RETURN(Tensor row, backend_.Allocate(kernels::DType::kF32, Shape{1, config_.hidden_size}));
  RETURN_IF_ERROR(backend_.GatherRows(x, std::span<const int32_t>(&last, 1), row));
  return Logits(row, weights_.lm_head);
}

void Model::AddLogitDelta(std::span<const float> delta, std::span<float> row) {
  for (size_t i = 0; i < delta.size() && i < row.size(); ++i) row[i] += delta[i];
}

absl::StatusOr<int32_t> Model::ForwardSampled(std::span<const int32_t> tokens, const kernels::SampleParams& params,
                                              std::span<const float> logit_delta) {
  if (const char* error = kernels::SampleParamsError(params); *error != '\0') {
    return absl::InvalidArgumentError(absl::StrCat("ForwardSampled: ", error));
  }
  if (!logit_delta.empty() && (tokens.size() != 1 || static_cast<int64_t>(logit_delta.size()) != config_.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardSampled: a logit delta of ", logit_delta.size(),
                                                   " values for ", tokens.size(), " tokens (want one token and ",
                                                   config_.vocab_size, " values)"));
  }
  int32_t id = kernels::kNoFiniteLogit;
  if (StepGraphApplies(tokens.size())) {
    std::vector<int32_t> ids(tokens.size(), kernels::kNoFiniteLogit);
    RETURN_IF_ERROR(
        GraphedForward(tokens, std::span<const kernels::SampleParams>(&params, 1), ids, logit_delta).status());
    if (!ids.empty()) id = ids.back();
  } else {
    ASSIGN_OR_RETURN(std::vector<float> logits, ForwardLast(tokens));
    AddLogitDelta(logit_delta, logits);
    id = kernels::SampleRowHost(logits, params);
  }
  if (id == kernels::kNoFiniteLogit) return absl::InvalidArgumentError("logits have no finite value");
  return id;
}

absl::StatusOr<std::vector<int32_t>> Model::ForwardSampledRows(std::span<const int32_t> tokens,
                                                               std::span<const kernels::SampleParams> rows) {
  if (rows.size() != 1 && rows.size() != tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ForwardSampledRows: ", rows.size(), " draws for ", tokens.size(), " tokens"));
  }
  for (const kernels::SampleParams& params : rows) {
    if (const char* error = kernels::SampleParamsError(params); *error != '\0') {
      return absl::InvalidArgumentError(absl::StrCat("ForwardSampledRows: ", error));
    }
  }
  std::vector<int32_t> ids(tokens.size(), kernels::kNoFiniteLogit);
  if (StepGraphApplies(tokens.size())) {
    RETURN_IF_ERROR(GraphedForward(tokens, rows, ids).status());
  } else {
    ASSIGN_OR_RETURN(const std::vector<float> logits, Forward(tokens));
    const size_t V = logits.size() / std::max<size_t>(1, tokens.size());
    for (size_t row = 0; row < tokens.size(); ++row) {
      ids[row] = kernels::SampleRowHost(std::span<const float>(logits).subspan(row * V, V),
                                        rows[rows.size() == 1 ? 0 : row]);
    }
  }
  if (std::find(ids.begin(), ids.end(), kernels::kNoFiniteLogit) != ids.end()) {
    return absl::InvalidArgumentError("logits have no finite value");
  }
  return ids;
}

absl::StatusOr<std::vector<float>> Model::ForwardMtp(std::span<const int32_t> next_tokens,
                                                     std::span<const float> hidden, int index) {
  if (StepGraphApplies(next_tokens.size(), index)) return GraphedMtpForward(next_tokens, hidden, index);
  Tensor u;
  RETURN_IF_ERROR(RunMtp(next_tokens, hidden, index, u));
  return Logits(u, weights_.mtp[index].head);
}

absl::StatusOr<std::vector<float>> Model::ForwardMtpLast(std::span<const int32_t> next_tokens,
                                                         std::span<const float> hidden, int index) {
  if (StepGraphApplies(next_tokens.size(), index)) {
    ASSIGN_OR_RETURN(std::vector<float> all, GraphedMtpForward(next_tokens, hidden, index));
    const size_t vocab = all.size() / next_tokens.size();
    all.erase(all.begin(), all.end() - static_cast<std::ptrdiff_t>(vocab));
    return all;
  }
  Tensor u;
  RETURN_IF_ERROR(RunMtp(next_tokens, hidden, index, u));
  const int32_t last = static_cast<int32_t>(next_tokens.size() - 1);
  ASSIGN_OR_RETURN(Tensor row, backend_.Allocate(kernels::DType::kF32, Shape{1, config_.hidden_size}));
  RETURN_IF_ERROR(backend_.GatherRows(u, std::span<const int32_t>(&last, 1), row));
  return Logits(row, weights_.mtp[index].head);
}

absl::Status Model::RunMtp(std::span<const int32_t> next_tokens, std::span<const float> hidden, int index,
                           Tensor& u) {
  if (index < 0 || index >= static_cast<int>(weights_.mtp.size())) {
    return absl::FailedPreconditionError(absl::StrCat("the checkpoint has ", weights_.mtp.size(),
                                                      " MTP layers; asked for layer ", index,
                                                      weights_.mtp_missing.empty() ? "" : " (",
                                                      weights_.mtp_missing, weights_.mtp_missing.empty() ? "" : ")"));
  }
  const int64_t T = static_cast<int64_t>(next_tokens.size()), D = config_.hidden_size;
  if (T == 0 || static_cast<int64_t>(hidden.size()) != T * D) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardMtp: ", T, " tokens with ", hidden.size(),
                                                   " hidden values (want tokens x ", D, ")"));
  }
  if (mtp_length_ + T > cache_.max_tokens()) {
    return absl::InvalidArgumentError("ForwardMtp: the MTP cache is full");
  }
  RETURN_IF_ERROR(cache_.CheckWritable(mtp_length_, T, "ForwardMtp"));
  const MtpWeights& m = weights_.mtp[index];
  RETURN_IF_ERROR(RefreshSlotTables());
  RETURN_IF_ERROR(BeginRoutingLog(T));
  ASSIGN_OR_RETURN(Tensor e, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
  RETURN_IF_ERROR(backend_.Embedding(next_tokens, weights_.embed, e));
  ASSIGN_OR_RETURN(Tensor h, kernels::UploadFloats(backend_, hidden, kernels::DType::kF32, Shape{T, D}));
  ASSIGN_OR_RETURN(u, MtpInput(m, e, h));
  const int64_t layer = config_.num_hidden_layers + index;
  selection_.reset();
  PendingResidual residual;
  RETURN_IF_ERROR(RunLayer(m.block, layer, static_cast<size_t>(layer), u, mtp_length_, &residual));
  mtp_length_ += T;
  RETURN_IF_ERROR(NormWithResidual(u, residual, m.head_norm, u));
  ASSIGN_OR_RETURN(last_mtp_hidden_, kernels::DownloadFloats(backend_, u));
  FlushRoutingLog();
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Model::MtpInput(const MtpWeights& m, Tensor& e, Tensor& h) {
  const float eps = static_cast<float>(config_.rms_norm_eps);
  RETURN_IF_ERROR(backend_.RmsNorm(e, m.enorm, eps, e));
  RETURN_IF_ERROR(backend_.RmsNorm(h, m.hnorm, eps, h));
  // eh_proj(concat(e, h)) = e · W_eᵀ + h · W_hᵀ.
  ASSIGN_OR_RETURN(Tensor u, backend_.Allocate(kernels::DType::kF32, e.shape()));
  ASSIGN_OR_RETURN(Tensor uh, backend_.Allocate(kernels::DType::kF32, e.shape()));
  RETURN_IF_ERROR(MatMul(backend_, e, m.eh_embed, u));
  RETURN_IF_ERROR(MatMul(backend_, h, m.eh_hidden, uh));
  RETURN_IF_ERROR(backend_.Add(u, uh, u));
  return u;
}

absl::Status Model::RopeMlaAndIndexer(Tensor& mla, Tensor* indexer, kernels::StepPosition start_pos) {
  const std::array<kernels::Backend::RopeTarget, 2> targets{
      {{.x = &mla, .interleaved = MlaRopeInterleaved(config_)},
       {.x = indexer, .interleaved = IndexerRopeInterleaved(config_)}}};
  return backend_.Rope(std::span(targets.data(), indexer != nullptr ? 2 : 1), start_pos, inv_freq_,
                       attention_scaling_);
}

absl::Status Model::NormWithResidual(Tensor& x, PendingResidual& pending, const Tensor& weight, Tensor& y) {
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (!options_.fused_residual_norm) RETURN_IF_ERROR(AddResidual(x, pending));
  if (pending.empty()) return backend_.RmsNorm(x, weight, eps, y);
  const kernels::Tensor* deltas[] = {&pending.first, &pending.second};
  RETURN_IF_ERROR(backend_.AddRmsNorm(x, std::span(deltas, pending.second.valid() ? 2 : 1), weight, eps, y));
  pending = PendingResidual{};
  return absl::OkStatus();
}

absl::Status Model::AddResidual(Tensor& x, PendingResidual& pending) {
  if (pending.empty()) return absl::OkStatus();
  // The deltas are this model's own temporaries: the first may take their sum.
  if (pending.second.valid()) RETURN_IF_ERROR(backend_.Add(pending.first, pending.second, pending.first));
  RETURN_IF_ERROR(backend_.Add(x, pending.first, x));
  pending = PendingResidual{};
  return absl::OkStatus();
}

absl::Status Model::RunLayer(const LayerWeights& w, int64_t layer, size_t cache_index, Tensor& x,
                             kernels::StepPosition start_pos, PendingResidual* pending) {
  PendingResidual own;
  PendingResidual& residual = pending != nullptr ? *pending : own;
  RETURN_IF_ERROR(AttentionResidual(w, layer, cache_index, x, start_pos, residual));
  RETURN_IF_ERROR(FfnResidual(w, layer, x, nullptr, nullptr, residual));
  return pending != nullptr ? absl::OkStatus() : AddResidual(x, own);
}

absl::Status Model::AttentionBlock(const LayerWeights& w, int64_t layer, size_t cache_index, Tensor& x,
                                   kernels::StepPosition start_pos) {
  PendingResidual residual;
  RETURN_IF_ERROR(AttentionResidual(w, layer, cache_index, x, start_pos, residual));
  return AddResidual(x, residual);
}

absl::Status Model::AttentionResidual(const LayerWeights& w, int64_t layer, size_t cache_index, Tensor& x,
                                      kernels::StepPosition start_pos, PendingResidual& pending) {
  ASSIGN_OR_RETURN(Tensor xn, backend_.Allocate(kernels::DType::kF32, x.shape()));
  RETURN_IF_ERROR(NormWithResidual(x, pending, w.input_norm, xn));
  ASSIGN_OR_RETURN(Tensor attention, Attention(w.attention, layer, cache_index, xn, start_pos));
  RETURN_IF_ERROR(AllReduce(attention));
  pending.first = std::move(attention);
  return absl::OkStatus();
}

absl::StatusOr<MoeRouting> Model::RouteLayer(const LayerWeights& w, const Tensor& x) {
  if (!w.moe.has_value()) return absl::InternalError("RouteLayer on a dense layer");
  ASSIGN_OR_RETURN(Tensor xn, backend_.Allocate(kernels::DType::kF32, x.shape()));
  RETURN_IF_ERROR(backend_.RmsNorm(x, w.post_attention_norm, static_cast<float>(config_.rms_norm_eps), xn));
  return Route(*w.moe, xn);
}

absl::Status Model::FfnBlock(const LayerWeights& w, int64_t layer, Tensor& x, const MoeRouting* routing,
                             const PrefillLayerSlots* slots) {
  PendingResidual residual;
  RETURN_IF_ERROR(FfnResidual(w, layer, x, routing, slots, residual));
  return AddResidual(x, residual);
}

absl::Status Model::FfnResidual(const LayerWeights& w, int64_t layer, Tensor& x, const MoeRouting* routing,
                                const PrefillLayerSlots* slots, PendingResidual& pending) {
  ASSIGN_OR_RETURN(Tensor xn, backend_.Allocate(kernels::DType::kF32, x.shape()));
  RETURN_IF_ERROR(NormWithResidual(x, pending, w.post_attention_norm, xn));
  Tensor ffn, shared;
  if (w.moe.has_value() && routing == nullptr && slots == nullptr && RoutesOnBackend(*w.moe)) {
    ASSIGN_OR_RETURN(std::tie(ffn, shared), BackendRoutedMoe(*w.moe, layer, xn));
  } else if (w.moe.has_value()) {
    MoeRouting own;
    if (routing == nullptr) {
      ASSIGN_OR_RETURN(own, Route(*w.moe, xn));
      if (ObservesRouting(layer)) routing_observer_(layer, own);
      routing = &own;
    }
    ASSIGN_OR_RETURN(ffn, Moe(*w.moe, layer, xn, *routing, slots));
  } else {
    ASSIGN_OR_RETURN(ffn, Mlp(*w.dense, xn));
  }
  // Tensor parallelism reduces the whole block's output, the shared expert's part included.
  if (shared.valid() && options_.tp.world_size > 1) {
    RETURN_IF_ERROR(backend_.Add(ffn, shared, ffn));
    shared = Tensor{};
  }
  RETURN_IF_ERROR(AllReduce(ffn));
  pending.first = std::move(ffn);
  pending.second = std::move(shared);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Model::Attention(const AttentionWeights& w, int64_t layer, size_t cache_index,
                                        const Tensor& xn, kernels::StepPosition start_pos) {
  const ModelConfig& c = config_;
  const int64_t T = xn.shape().dim(0);
  const int64_t Hr = w.w_uk.shape().dim(0), dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim;
  const int64_t dv = c.v_head_dim, kv = c.kv_lora_rank;
  LayerCache& cache = cache_.layer(cache_index);

  // Every projection of xn in one MatMulSharedInput (one GEMV launch on the GPU, where each of
  // them alone leaves most SMs idle): the query latent (or, without one, the query heads), the
  // key latent and rope key, and the DSA indexer's key and head weights.
  const IndexerWeights* ix = w.indexer.has_value() ? &*w.indexer : nullptr;
  const int64_t Hi = c.indexer.n_heads, Di = c.indexer.head_dim;
  ASSIGN_OR_RETURN(Tensor q_nope, backend_.Allocate(kernels::DType::kF32, Shape{T, Hr * dn}));
  ASSIGN_OR_RETURN(Tensor q_pe, backend_.Allocate(kernels::DType::kF32, Shape{T, Hr * dr}));
  ASSIGN_OR_RETURN(Tensor latent, backend_.Allocate(kernels::DType::kF32, Shape{T, kv}));
  ASSIGN_OR_RETURN(Tensor k_pe, backend_.Allocate(kernels::DType::kF32, Shape{T, dr}));
  Tensor q_latent, ki, head_weights;
  std::vector<kernels::Backend::WeightRef> from_xn_w{w.kv_a.Ref(), w.k_pe_proj.Ref()};
  std::vector<Tensor*> from_xn{&latent, &k_pe};
  if (w.q_a.has_value()) {
    ASSIGN_OR_RETURN(q_latent, backend_.Allocate(kernels::DType::kF32, Shape{T, c.q_lora_rank}));
    from_xn_w.push_back(w.q_a->Ref());
    from_xn.push_back(&q_latent);
  } else {
    from_xn_w.insert(from_xn_w.end(), {w.q_nope.Ref(), w.q_pe.Ref()});
    from_xn.insert(from_xn.end(), {&q_nope, &q_pe});
  }
  if (ix != nullptr) {
    ASSIGN_OR_RETURN(ki, backend_.Allocate(kernels::DType::kF32, Shape{T, Di}));
    // weights_proj was scaled at load by index_n_heads^-0.5 * index_head_dim^-0.5 (ReLU is
    // positively homogeneous, so the score scale folds into the head weights).
    ASSIGN_OR_RETURN(head_weights, backend_.Allocate(kernels::DType::kF32, Shape{T, Hi}));
    from_xn_w.insert(from_xn_w.end(), {ix->wk.Ref(), ix->weights_proj.Ref()});
    from_xn.insert(from_xn.end(), {&ki, &head_weights});
  }
  RETURN_IF_ERROR(backend_.MatMulSharedInput(xn, from_xn_w, from_xn));

  // The new tokens' keys go straight into the cache: the normalised latent, the rotated rope key
  // and the indexer's normalised, rotated key. They need nothing of the queries, so on the side
  // stream they run beside the query projection (a few small launches hidden behind its GEMV).
  kernels::SideWorkGuard side(backend_);
  if (options_.side_streams) RETURN_IF_ERROR(backend_.BeginSideWork());
  RETURN_IF_ERROR(backend_.RmsNorm(latent, w.kv_a_norm, kLatentNormEps, latent));
  RETURN_IF_ERROR(k_pe.Reshape(Shape{T, 1, dr}));
  if (ix != nullptr) {
    RETURN_IF_ERROR(backend_.LayerNorm(ki, ix->k_norm_weight, ix->k_norm_bias, kLatentNormEps, ki));
    RETURN_IF_ERROR(ki.Reshape(Shape{T, 1, Di}));
  }
  RETURN_IF_ERROR(RopeMlaAndIndexer(k_pe, ix != nullptr ? &ki : nullptr, start_pos));
  RETURN_IF_ERROR(k_pe.Reshape(Shape{T, dr}));
  RETURN_IF_ERROR(backend_.WriteRows(latent, cache.latent, start_pos));
  RETURN_IF_ERROR(backend_.WriteRows(k_pe, cache.k_pe, start_pos));
  if (ix != nullptr) {
    RETURN_IF_ERROR(ki.Reshape(Shape{T, Di}));
    RETURN_IF_ERROR(backend_.WriteRows(ki, *cache.index_keys, start_pos));
  }
  // The slot mailbox's apply, once per forward of the main stack: its PCIe round trip hides
  // beside the query path here, where at the first MoE block the router would wait for it.
  if (options_.side_streams && layer < c.num_hidden_layers) RETURN_IF_ERROR(ApplyMailboxIfDue());
  if (options_.side_streams) RETURN_IF_ERROR(backend_.EndSideWork());

  // The per-head query parts (and the indexer's queries) from the normalised query latent.
  Tensor qi;
  if (w.q_a.has_value()) {
    RETURN_IF_ERROR(backend_.RmsNorm(q_latent, *w.q_a_norm, kLatentNormEps, q_latent));
    std::vector<kernels::Backend::WeightRef> from_q_w{w.q_nope.Ref(), w.q_pe.Ref()};
    std::vector<Tensor*> from_q{&q_nope, &q_pe};
    if (ix != nullptr) {
      ASSIGN_OR_RETURN(qi, backend_.Allocate(kernels::DType::kF32, Shape{T, Hi * Di}));
      from_q_w.push_back(ix->wq_b.Ref());
      from_q.push_back(&qi);
    }
    RETURN_IF_ERROR(backend_.MatMulSharedInput(q_latent, from_q_w, from_q));
  }
  RETURN_IF_ERROR(q_nope.Reshape(Shape{T, Hr, dn}));
  RETURN_IF_ERROR(q_pe.Reshape(Shape{T, Hr, dr}));
  if (ix != nullptr) {
    if (!qi.valid()) return absl::InternalError(absl::StrCat("layer ", layer, ": a DSA indexer without a query latent"));
    RETURN_IF_ERROR(qi.Reshape(Shape{T, Hi, Di}));
  }
  RETURN_IF_ERROR(RopeMlaAndIndexer(q_pe, ix != nullptr ? &qi : nullptr, start_pos));
  // The indexer and attention read the keys just written.
  if (options_.side_streams) RETURN_IF_ERROR(backend_.JoinSideWork());

  // DSA: a full layer scores every visible key with its indexer and keeps the top-k; a
  // shared layer reuses the selection of the last full layer of this forward.
  if (ix != nullptr) {
    ASSIGN_OR_RETURN(Tensor selected, backend_.Allocate(kernels::DType::kI32, Shape{T, c.indexer.topk}));
    RETURN_IF_ERROR(backend_.IndexerTopK(qi, *cache.index_keys, head_weights, start_pos, selected));
    selection_ = std::move(selected);
  } else if (c.indexer.enabled && !selection_.has_value()) {
    return absl::InternalError(absl::StrCat("layer ", layer, " shares a DSA selection but no full layer ran before it"));
  }

  ASSIGN_OR_RETURN(Tensor heads, backend_.Allocate(kernels::DType::kF32, Shape{T, Hr * dv}));
  const Tensor* selected = c.indexer.enabled ? &*selection_ : nullptr;
  RETURN_IF_ERROR(backend_.MlaAttention(q_nope, q_pe, cache.latent, cache.k_pe, w.w_uk, w.w_uv, selected,
                                        start_pos, softmax_scale_, heads));
  ASSIGN_OR_RETURN(Tensor out, backend_.Allocate(kernels::DType::kF32, Shape{T, c.hidden_size}));
  RETURN_IF_ERROR(MatMul(backend_, heads, w.o_proj, out));
  return out;
}

absl::StatusOr<Tensor> Model::Mlp(const MlpWeights& w, const Tensor& xn, std::vector<float>* down_input) {
  const int64_t T = xn.shape().dim(0), I2 = w.gate_up.shape().dim(0);
  ASSIGN_OR_RETURN(Tensor gate_up, backend_.Allocate(kernels::DType::kF32, Shape{T, I2}));
  RETURN_IF_ERROR(MatMul(backend_, xn, w.gate_up, gate_up));
  ASSIGN_OR_RETURN(Tensor act, backend_.Allocate(kernels::DType::kF32, Shape{T, I2 / 2}));
  RETURN_IF_ERROR(backend_.SiluAndMul(gate_up, act));
  if (down_input != nullptr) {
    ASSIGN_OR_RETURN(*down_input, kernels::DownloadFloats(backend_, act));
  }
  ASSIGN_OR_RETURN(Tensor out, backend_.Allocate(kernels::DType::kF32, Shape{T, config_.hidden_size}));
  RETURN_IF_ERROR(MatMul(backend_, act, w.down, out));
  return out;
}

absl::StatusOr<MoeRouting> Model::Route(const MoeWeights& w, const Tensor& xn) {
  const ModelConfig& c = config_;
  const int64_t T = xn.shape().dim(0), E = c.n_routed_experts;
  // Router logits on the backend, the (small) routing decision on the host.
  ASSIGN_OR_RETURN(Tensor logits, backend_.Allocate(kernels::DType::kF32, Shape{T, E}));
  RETURN_IF_ERROR(backend_.MatMul(xn, w.router_device, logits));
  ASSIGN_OR_RETURN(std::vector<float> host_logits, kernels::DownloadFloats(backend_, logits));
  ASSIGN_OR_RETURN(MoeRouting routing, RouteTokens(host_logits, w.bias, RoutingParams(c)));
  // The predictor's salience signal (issue #21) wants each token's input energy; only routing
  // observers (the worker's reports, nq trace, nq kld --mode live) read it, so a forward
  // without one skips it.
  if (routing_observer_) {
    ASSIGN_OR_RETURN(routing.input_sq_norms, InputSquaredNorms(xn));
  }
  return routing;
}

absl::StatusOr<std::vector<float>> Model::InputSquaredNorms(const Tensor& xn) {
  const int64_t T = xn.shape().dim(0);
  ASSIGN_OR_RETURN(std::vector<float> host_xn, kernels::DownloadFloats(backend_, xn));
  const size_t width = host_xn.size() / static_cast<size_t>(T);
  std::vector<float> norms(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0;
    for (size_t i = 0; i < width; ++i) {
      const double v = host_xn[static_cast<size_t>(t) * width + i];
      sum += v * v;
    }
    norms[static_cast<size_t>(t)] = static_cast<float>(sum);
  }
  return norms;
}

bool Model::RoutesOnBackend(const MoeWeights& w) const {
  // Packed layers need their slot tables on the device (a table source, or static choices); NVFP4
  // layers have no slots. The expert observer (nq calibrate) reads each expert's inputs on the host.
  const bool experts_on_device = (w.packed.has_value() && (slot_table_source_.has_value() || !slot_source_)) ||
                                 w.nvfp4.has_value();
  return experts_on_device && !observer_ && (w.bias.empty() || w.bias_device.valid());
}

absl::StatusOr<std::pair<Tensor, Tensor>> Model::BackendRoutedMoe(const MoeWeights& w, int64_t layer,
                                                                   const Tensor& xn) {
  const ModelConfig& c = config_;
  const int64_t T = xn.shape().dim(0), E = c.n_routed_experts, K = c.num_experts_per_tok;
  // The predictor's salience signal (issue #21) wants each token's squared input norm. A decode
  // step's few tokens get it where xn is, as the diagonal of xn xnᵀ (one tiny GEMV), copied out
  // with the routing; a longer forward on the CPU sums it on the host (its xn is there), and on
  // a GPU reports none (the streamer reads a missing norm as 1).
  const bool norms_by_gram = ObservesRouting(layer) && T <= kMaxStepGraphTokens;
  // The host's sum happens here, before any side work, which allows no host round trip until it
  // is joined (Backend::BeginSideWork).
  std::vector<float> host_sq_norms;
  if (ObservesRouting(layer) && !norms_by_gram && backend_.name() == "cpu") {
    ASSIGN_OR_RETURN(host_sq_norms, InputSquaredNorms(xn));
  }
  // The shared expert and that GEMV read only xn: on the side stream they run beside the router
  // and the routed experts, whose small kernels leave most of the GPU idle. The side forks at xn,
  // but the router's GEMV is issued first: issued after the shared expert's gate/up GEMV, whose
  // blocks fill every SM, its clustered blocks waited for that GEMV's end (the H100 kernel trace:
  // 20 us of each MoE layer's critical path).
  kernels::SideWorkGuard side(backend_);
  const bool use_side = options_.side_streams && (w.shared.has_value() || norms_by_gram);
  if (use_side) {
    RETURN_IF_ERROR(backend_.BeginSideWork());
    RETURN_IF_ERROR(backend_.EndSideWork());
  }
  ASSIGN_OR_RETURN(Tensor logits, backend_.Allocate(kernels::DType::kF32, Shape{T, E}));
  RETURN_IF_ERROR(backend_.MatMul(xn, w.router_device, logits));
  if (use_side) RETURN_IF_ERROR(backend_.ContinueSideWork());
  // The gram before the shared expert: issued after it, its clustered GEMV waited for the routed
  // experts' down GEMV to leave the SMs, and the next norm for its copy (13 us a layer in the H100
  // kernel trace); first, it runs beside the router (GLM-5 slice +1.6-2.4 %, bench/README.md).
  Tensor shared, gram;
  if (norms_by_gram) {
    ASSIGN_OR_RETURN(gram, backend_.Allocate(kernels::DType::kF32, Shape{T, T}));
    RETURN_IF_ERROR(backend_.MatMul(xn, xn, gram));
  }
  if (w.shared.has_value()) {
    ASSIGN_OR_RETURN(shared, Mlp(*w.shared, xn));
  }
  if (use_side) RETURN_IF_ERROR(backend_.EndSideWork());
  ASSIGN_OR_RETURN(Tensor ids, backend_.Allocate(kernels::DType::kI32, Shape{T, K}));
  ASSIGN_OR_RETURN(Tensor weights, backend_.Allocate(kernels::DType::kF32, Shape{T, K}));
  RETURN_IF_ERROR(backend_.MoeRoute(logits, w.bias.empty() ? nullptr : &w.bias_device, RoutingParams(c), ids, weights));
  // The routing log's copies to the host (ids, weights, the gram) go to the side stream with
  // side streams on: on the main stream each is a copy node between two kernels, which breaks
  // their programmatic launch (the H100 kernel trace: 16 us from the routing to the experts'
  // first kernel, 14 us from their last to the next norm).
  const bool logs = ObservesRouting(layer) || (slot_table_source_.has_value() && slot_table_source_->count);
  const bool log_on_side = logs && options_.side_streams;
  if (log_on_side) RETURN_IF_ERROR(backend_.BeginSideWork());
  if (logs) {
    const size_t bytes = static_cast<size_t>(T * K) * sizeof(int32_t);
    if (routing_staging_ == nullptr) return absl::InternalError("routing staging missing (BeginRoutingLog not run)");
    if (routing_staging_used_ + 2 * bytes > routing_staging_->bytes()) {
      return absl::InternalError(absl::StrCat("layer ", layer, ": the routing staging holds ", routing_staging_->bytes(),
                                              " bytes, ", routing_staging_used_ + 2 * bytes, " needed"));
    }
    std::byte* at = static_cast<std::byte*>(routing_staging_->data()) + routing_staging_used_;
    RETURN_IF_ERROR(backend_.CopyToHostAsync(ids, std::span<std::byte>(at, bytes)));
    RETURN_IF_ERROR(backend_.CopyToHostAsync(weights, std::span<std::byte>(at + bytes, bytes)));
    LoggedRouting logged{.layer = layer, .tokens = static_cast<int>(T), .top_k = static_cast<int>(K),
                         .offset = routing_staging_used_};
    routing_staging_used_ += 2 * bytes;
    if (norms_by_gram) {
      // Its GEMV ran on the side stream (or on the main one before this copy).
      const size_t gram_bytes = static_cast<size_t>(T * T) * sizeof(float);
      if (routing_staging_used_ + gram_bytes > routing_staging_->bytes()) {
        return absl::InternalError(absl::StrCat("layer ", layer, ": the routing staging holds ",
                                                routing_staging_->bytes(), " bytes, ",
                                                routing_staging_used_ + gram_bytes, " needed"));
      }
      logged.gram_offset = static_cast<int64_t>(routing_staging_used_);
      routing_staging_used_ += gram_bytes;
      std::byte* gram_at = static_cast<std::byte*>(routing_staging_->data()) + logged.gram_offset;
      RETURN_IF_ERROR(backend_.CopyToHostAsync(gram, std::span<std::byte>(gram_at, gram_bytes)));
    } else {
      logged.input_sq_norms = std::move(host_sq_norms);
    }
    routing_log_.push_back(std::move(logged));
  } else if (norms_by_gram) {
    return absl::InternalError("a routing observer without its routing log");
  }
  if (log_on_side) RETURN_IF_ERROR(backend_.EndSideWork());
  ASSIGN_OR_RETURN(Tensor out, backend_.Allocate(kernels::DType::kF32, Shape{T, c.hidden_size}));
  if (w.nvfp4.has_value()) {
    RETURN_IF_ERROR(backend_.Nvfp4Moe(xn, ids, weights, w.nvfp4->weights, out));
  } else {
    const PackedExperts& packed = *w.packed;
    kernels::NqSlots nq_slots = LayerSlots(packed, layer, nullptr);
    ASSIGN_OR_RETURN(std::tie(nq_slots.slot_of_expert, nq_slots.slot_table_row), SlotTableFor(layer));
    RETURN_IF_ERROR(backend_.NqMoe(xn, ids, weights, packed.weights, nq_slots, out));
  }
  if (use_side || log_on_side) RETURN_IF_ERROR(backend_.JoinSideWork());
  return std::pair(std::move(out), std::move(shared));
}

absl::Status Model::SetSlotMailbox(const kernels::SlotMailboxRow& rows, const std::vector<int64_t>& layers) {
  const int64_t E = config_.n_routed_experts, L = static_cast<int64_t>(layers.size());
  if (L == 0 || rows.experts != L * E) {
    return absl::InvalidArgumentError(absl::StrCat("slot mailbox: a row of ", rows.experts, " entries for ", L,
                                                   " layers of ", E, " experts"));
  }
  Mailbox mailbox{.row = rows};
  for (int64_t i = 0; i < L; ++i) {
    if (!slot_tables_.contains(layers[static_cast<size_t>(i)])) {
      return absl::InvalidArgumentError(
          absl::StrCat("slot mailbox: layer ", layers[static_cast<size_t>(i)], " has no packed routed experts"));
    }
    mailbox.row_of_layer[layers[static_cast<size_t>(i)]] = i;
  }
  const std::vector<uint64_t> empty(static_cast<size_t>(L * E), kernels::kMailboxEmptyEntry);
  ASSIGN_OR_RETURN(mailbox.applied, backend_.Allocate(kernels::DType::kI32, Shape{L * E, 2}));
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const uint64_t>(empty)), mailbox.applied));
  const std::vector<int32_t> unmapped(static_cast<size_t>(L * E), -1);
  ASSIGN_OR_RETURN(mailbox.table, backend_.Allocate(kernels::DType::kI32, Shape{L, E}));
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(unmapped)), mailbox.table));
  mailbox_ = std::move(mailbox);
  uploaded_generation_.reset();
  step_graphs_.clear();
  return absl::OkStatus();
}

absl::Status Model::ApplyMailboxIfDue() {
  if (!mailbox_.has_value() || !mailbox_->apply_due) return absl::OkStatus();
  RETURN_IF_ERROR(backend_.ApplySlotMailbox(mailbox_->row, mailbox_->applied, mailbox_->table));
  mailbox_->apply_due = false;
  return absl::OkStatus();
}

absl::StatusOr<std::pair<const Tensor*, int64_t>> Model::SlotTableFor(int64_t layer) {
  if (mailbox_.has_value()) {
    if (auto it = mailbox_->row_of_layer.find(layer); it != mailbox_->row_of_layer.end()) {
      RETURN_IF_ERROR(ApplyMailboxIfDue());  // on the main stream: attention's side work did not
      return std::make_pair(static_cast<const Tensor*>(&mailbox_->table), it->second);
    }
  }
  return std::make_pair(static_cast<const Tensor*>(&slot_tables_.at(layer)), int64_t{0});
}

absl::Status Model::RefreshSlotTables() {
  const uint64_t generation = slot_table_source_.has_value() ? slot_table_source_->generation() : 0;
  if (uploaded_generation_ == generation) return absl::OkStatus();
  std::vector<int32_t> slots(static_cast<size_t>(config_.n_routed_experts));
  for (auto& [layer, table] : slot_tables_) {
    if (mailbox_.has_value() && mailbox_->row_of_layer.contains(layer)) continue;  // the mailbox decides
    std::fill(slots.begin(), slots.end(), -1);
    const LayerWeights& lw = layer < config_.num_hidden_layers
                                 ? weights_.layers[static_cast<size_t>(layer)]
                                 : weights_.mtp[static_cast<size_t>(layer - config_.num_hidden_layers)].block;
    if (slot_table_source_.has_value()) {
      slot_table_source_->fill(layer, slots);
    } else if (!lw.moe->packed->static_slots.empty()) {
      slots = lw.moe->packed->static_slots;
    }
    RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(slots)), table));
  }
  uploaded_generation_ = generation;
  return absl::OkStatus();
}

absl::Status Model::BeginRoutingLog(int64_t tokens) {
  MailboxForwardBegins();  // every forward starts here
  // A forward that failed may have left copies in flight into the staging.
  const bool in_flight = !routing_log_.empty();
  routing_log_.clear();
  routing_staging_used_ = 0;
  const bool wanted = routing_observer_ || (slot_table_source_.has_value() && slot_table_source_->count);
  if (!wanted) return absl::OkStatus();
  const size_t layers = weights_.layers.size() + weights_.mtp.size();
  // Per layer: ids and weights, and for a decode step with an observer the xn xnᵀ whose diagonal
  // is the tokens' squared input norms (BackendRoutedMoe).
  // A decode step's gram is at most kMaxStepGraphTokens squared (a drafting chain logs several
  // forwards of up to that many tokens under one count of all their entries).
  const int64_t gram_tokens = std::min(tokens, kMaxStepGraphTokens);
  const size_t gram = routing_observer_ ? static_cast<size_t>(gram_tokens * gram_tokens) : 0;
  const size_t need =
      layers * (static_cast<size_t>(tokens * config_.num_experts_per_tok) * 2 * sizeof(int32_t) + gram * sizeof(float));
  if (routing_staging_ == nullptr || routing_staging_->bytes() < need) {
    if (in_flight) RETURN_IF_ERROR(backend_.Synchronize());
    const size_t grown = kernels::GrownCapacity(need, routing_staging_ != nullptr ? routing_staging_->bytes() : 0);
    routing_staging_.reset();
    ASSIGN_OR_RETURN(routing_staging_, backend_.AllocateHostStaging(grown));
    ++routing_staging_generation_;
  }
  return absl::OkStatus();
}

void Model::FlushRoutingLog() {
  const std::byte* base = routing_staging_ != nullptr ? static_cast<const std::byte*>(routing_staging_->data()) : nullptr;
  for (const LoggedRouting& logged : routing_log_) {
    MoeRouting routing;
    routing.num_tokens = logged.tokens;
    routing.top_k = logged.top_k;
    const size_t n = static_cast<size_t>(logged.tokens) * logged.top_k;
    routing.experts.resize(n);
    routing.weights.resize(n);
    std::memcpy(routing.experts.data(), base + logged.offset, n * sizeof(int32_t));
    std::memcpy(routing.weights.data(), base + logged.offset + n * sizeof(int32_t), n * sizeof(float));
    routing.input_sq_norms = logged.input_sq_norms;
    if (logged.gram_offset >= 0) {
      // The diagonal of the tokens' xn xnᵀ.
      const auto* gram = reinterpret_cast<const float*>(base + logged.gram_offset);
      routing.input_sq_norms.resize(static_cast<size_t>(logged.tokens));
      for (int t = 0; t < logged.tokens; ++t) routing.input_sq_norms[static_cast<size_t>(t)] = gram[t * logged.tokens + t];
    }
    if (slot_table_source_.has_value() && slot_table_source_->count) slot_table_source_->count(logged.layer, routing);
    if (ObservesRouting(logged.layer)) routing_observer_(logged.layer, routing);
  }
  routing_log_.clear();
  routing_staging_used_ = 0;
}

absl::StatusOr<Tensor> Model::Moe(const MoeWeights& w, int64_t layer, const Tensor& xn, const MoeRouting& routing,
                                  const PrefillLayerSlots* slots) {
  const ModelConfig& c = config_;
  const int64_t T = xn.shape().dim(0), E = c.n_routed_experts;
  if (routing.num_tokens != T) {
    return absl::InternalError(absl::StrCat("layer ", layer, ": routing of ", routing.num_tokens, " tokens for ", T));
  }
  if (w.packed.has_value() || w.nvfp4.has_value()) {
    Tensor routed;
    if (w.nvfp4.has_value()) {
      ASSIGN_OR_RETURN(routed, Nvfp4Moe(*w.nvfp4, xn, routing));
    } else {
      ASSIGN_OR_RETURN(routed, PackedMoe(*w.packed, layer, xn, routing, slots));
    }
    if (!w.shared.has_value()) return routed;
    ASSIGN_OR_RETURN(Tensor shared, Mlp(*w.shared, xn));
    RETURN_IF_ERROR(backend_.Add(routed, shared, routed));
    return routed;
  }
  // Tokens per expert, then each used expert once over its tokens.
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(E));
  std::vector<std::vector<float>> weights(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < routing.top_k; ++j) {
      const int32_t e = routing.experts[t * routing.top_k + j];
      rows[e].push_back(static_cast<int32_t>(t));
      weights[e].push_back(routing.weights[t * routing.top_k + j]);
    }
  }
  Tensor out;
  if (w.shared.has_value()) {
    ASSIGN_OR_RETURN(out, Mlp(*w.shared, xn));
  } else {
    ASSIGN_OR_RETURN(out, Zeros(Shape{T, c.hidden_size}));
  }
  for (int64_t e = 0; e < E; ++e) {
    if (rows[e].empty()) continue;
    const int64_t n = static_cast<int64_t>(rows[e].size());
    ASSIGN_OR_RETURN(Tensor xe, backend_.Allocate(kernels::DType::kF32, Shape{n, c.hidden_size}));
    RETURN_IF_ERROR(backend_.GatherRows(xn, rows[e], xe));
    const MlpWeights* expert = &w.experts[e];
    std::vector<float> down_input;
    ASSIGN_OR_RETURN(Tensor ye, Mlp(*expert, xe, observer_ ? &down_input : nullptr));
    if (observer_) {
      ASSIGN_OR_RETURN(std::vector<float> gate_input, kernels::DownloadFloats(backend_, xe));
      observer_({.layer = layer, .expert = static_cast<int32_t>(e), .down_input = false, .dim = c.hidden_size,
                 .rows = gate_input});
      observer_({.layer = layer, .expert = static_cast<int32_t>(e), .down_input = true,
                 .dim = static_cast<int64_t>(down_input.size()) / n, .rows = down_input});
    }
    RETURN_IF_ERROR(backend_.ScatterAddRows(ye, rows[e], weights[e], out));
  }
  return out;
}

absl::StatusOr<Tensor> Model::PackedMoe(const PackedExperts& w, int64_t layer, const Tensor& xn,
                                        const MoeRouting& routing, const PrefillLayerSlots* prefill) {
  const int64_t T = xn.shape().dim(0), E = config_.n_routed_experts, K = routing.top_k;
  // Which slot each expert's residual sits in: a layer-major prefill's own slots, a per-expert
  // source's choice (nq kld) for the experts this forward uses, else the tables RefreshSlotTables
  // keeps (the table source's, or the layer's static choice).
  Tensor& table = slot_tables_.at(layer);
  if (prefill != nullptr || (!slot_table_source_.has_value() && slot_source_)) {
    std::vector<int32_t> slots(static_cast<size_t>(E), -1);
    if (prefill != nullptr) {
      if (static_cast<int64_t>(prefill->slot_of_expert.size()) != E) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": prefill slots name ",
                                                       prefill->slot_of_expert.size(), " experts of ", E));
      }
      slots = prefill->slot_of_expert;
    } else {
      std::vector<int64_t> tokens(static_cast<size_t>(E), 0);
      for (int32_t e : routing.experts) ++tokens[e];
      for (int64_t e = 0; e < E; ++e) {
        if (tokens[e] > 0) slots[e] = slot_source_(layer, static_cast<int32_t>(e), tokens[e]);
      }
    }
    RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(slots)), table));
    uploaded_generation_.reset();  // this layer's table no longer holds the tables' choice
  } else {
    RETURN_IF_ERROR(RefreshSlotTables());
    if (slot_table_source_.has_value() && slot_table_source_->count) slot_table_source_->count(layer, routing);
  }
  kernels::NqSlots nq_slots = LayerSlots(w, layer, prefill);
  // A prefill's scattered slots: the address table goes up with the call (slots x 8 bytes).
  Tensor slot_records;
  if (prefill != nullptr && !prefill->slot_records.empty()) {
    if (static_cast<int64_t>(prefill->slot_records.size()) != prefill->num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": prefill slots give ",
                                                     prefill->slot_records.size(), " record addresses for ",
                                                     prefill->num_slots, " slots"));
    }
    const std::span<const std::byte> addresses = std::as_bytes(std::span<const std::byte* const>(prefill->slot_records));
    ASSIGN_OR_RETURN(slot_records,
                     backend_.Allocate(kernels::DType::kU8, Shape{static_cast<int64_t>(addresses.size())}));
    RETURN_IF_ERROR(backend_.CopyFromHost(addresses, slot_records));
    nq_slots.slot_records = &slot_records;
  }
  nq_slots.slot_of_expert = &table;
  if (prefill == nullptr && !(!slot_table_source_.has_value() && slot_source_)) {
    ASSIGN_OR_RETURN(std::tie(nq_slots.slot_of_expert, nq_slots.slot_table_row), SlotTableFor(layer));
  }
  ASSIGN_OR_RETURN(Tensor ids, kernels::UploadInt32s(backend_, routing.experts, Shape{T, K}));
  ASSIGN_OR_RETURN(Tensor weights, kernels::UploadFloats(backend_, routing.weights, kernels::DType::kF32, Shape{T, K}));
  ASSIGN_OR_RETURN(Tensor out, backend_.Allocate(kernels::DType::kF32, Shape{T, config_.hidden_size}));
  RETURN_IF_ERROR(backend_.NqMoe(xn, ids, weights, w.weights, nq_slots, out));
  return out;
}

kernels::NqSlots Model::LayerSlots(const PackedExperts& w, int64_t layer, const PrefillLayerSlots* prefill) const {
  kernels::NqSlots nq_slots;
  if (prefill != nullptr) {
    // Scattered slots still name an arena (NqSlots): any record says there are slots.
    nq_slots.arena = prefill->arena != nullptr || prefill->slot_records.empty() ? prefill->arena
                                                                                 : prefill->slot_records.front();
    nq_slots.slot_bytes = prefill->slot_bytes;
    nq_slots.num_slots = prefill->num_slots;
  } else if (arena_.has_value()) {
    if (auto it = arena_->layer_offsets.find(layer); it != arena_->layer_offsets.end()) {
      nq_slots.arena = arena_->base + it->second;
      nq_slots.slot_bytes = arena_->slot_bytes;
      nq_slots.num_slots = arena_->slots_per_layer;
    }
  } else if (w.records.valid()) {
    nq_slots.arena = static_cast<const std::byte*>(w.records.data());
    nq_slots.slot_bytes = w.record_bytes;
    nq_slots.num_slots = w.record_bytes > 0 ? static_cast<int64_t>(w.records.nbytes()) / w.record_bytes : 0;
  }
  return nq_slots;
}

absl::StatusOr<Tensor> Model::Nvfp4Moe(const Nvfp4Experts& w, const Tensor& xn, const MoeRouting& routing) {
  const int64_t T = xn.shape().dim(0), K = routing.top_k;
  ASSIGN_OR_RETURN(Tensor ids, kernels::UploadInt32s(backend_, routing.experts, Shape{T, K}));
  ASSIGN_OR_RETURN(Tensor weights, kernels::UploadFloats(backend_, routing.weights, kernels::DType::kF32, Shape{T, K}));
  ASSIGN_OR_RETURN(Tensor out, backend_.Allocate(kernels::DType::kF32, Shape{T, config_.hidden_size}));
  RETURN_IF_ERROR(backend_.Nvfp4Moe(xn, ids, weights, w.weights, out));
  return out;
}

absl::StatusOr<Tensor> Model::HeadLogits(const Tensor& hidden_normed, const Tensor& head) {
  const int64_t T = hidden_normed.shape().dim(0), Vr = head.shape().dim(0), W = options_.tp.world_size;
  ASSIGN_OR_RETURN(Tensor local, backend_.Allocate(kernels::DType::kF32, Shape{T, Vr}));
  RETURN_IF_ERROR(backend_.MatMul(hidden_normed, head, local));
  if (W == 1) return local;
  // Each rank holds a block of vocabulary columns: gather them, [W, T, Vr].
  ASSIGN_OR_RETURN(Tensor gathered, backend_.Allocate(kernels::DType::kF32, Shape{W, T, Vr}));
  RETURN_IF_ERROR(comm_->AllGather(local, gathered));
  return gathered;
}

absl::StatusOr<Tensor> Model::LogitRows(const Tensor& hidden_normed, const Tensor& head) {
  const int64_t T = hidden_normed.shape().dim(0), W = options_.tp.world_size;
  ASSIGN_OR_RETURN(Tensor logits, HeadLogits(hidden_normed, head));
  if (W > 1 && T > 1) {
    ASSIGN_OR_RETURN(logits, InterleaveRankBlocks(std::move(logits)));
  }
  RETURN_IF_ERROR(logits.Reshape(Shape{T, head.shape().dim(0) * W}));
  return logits;
}

absl::StatusOr<Tensor> Model::InterleaveRankBlocks(Tensor gathered) {
  const int64_t W = gathered.shape().dim(0), T = gathered.shape().dim(1), Vr = gathered.shape().dim(2);
  RETURN_IF_ERROR(gathered.Reshape(Shape{W * T, Vr}));
  ASSIGN_OR_RETURN(Tensor rows, backend_.Allocate(kernels::DType::kF32, Shape{T * W, Vr}));
  // Row t * W + r of the result (token t's block of rank r) is row r * T + t of the gathered ones.
  for (int64_t r = 0; r < W; ++r) {
    for (int64_t t = 0; t < T; ++t) RETURN_IF_ERROR(backend_.CopyRows(gathered, r * T + t, rows, t * W + r, 1));
  }
  return rows;
}

absl::StatusOr<std::vector<float>> Model::Logits(const Tensor& hidden_normed, const Tensor& head) {
  const int64_t T = hidden_normed.shape().dim(0), Vr = head.shape().dim(0), W = options_.tp.world_size;
  ASSIGN_OR_RETURN(Tensor gathered, HeadLogits(hidden_normed, head));
  ASSIGN_OR_RETURN(std::vector<float> parts, kernels::DownloadFloats(backend_, gathered));
  if (W == 1) return parts;
  // Interleave the ranks' blocks [W, T, Vr] to [T, V].
  std::vector<float> logits(static_cast<size_t>(T * Vr * W));
  for (int64_t r = 0; r < W; ++r) {
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(parts.begin() + (r * T + t) * Vr, Vr, logits.begin() + t * Vr * W + r * Vr);
    }
  }
  return logits;
}

}  // namespace nq::model
