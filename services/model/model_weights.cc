#include "services/model/model_weights.h"

#include <algorithm>
#include <span>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "kernels/fp8_block_quantize.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/model/absorbed_dtype.h"
#include "services/model/safetensors_load.h"
#include "services/model/tensor_manifest.h"

namespace nq::model {
namespace {

using kernels::Backend;
using kernels::Shape;
using kernels::Tensor;

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? ", " : "", shape[i]);
  return s + "]";
}

// Reads one weight as float and checks its shape against the config.
class HostLoader {
 public:
  HostLoader(const Checkpoint& checkpoint, Backend& backend, kernels::DType matrix_dtype)
      : checkpoint_(checkpoint), backend_(backend), matrix_dtype_(matrix_dtype) {}

  absl::StatusOr<FloatTensor> Read(const std::string& name, std::vector<int64_t> shape) const {
    ASSIGN_OR_RETURN(FloatTensor t, LoadFloat32(checkpoint_, name));
    if (t.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape ", ShapeString(t.shape),
                                                     ", the config implies ", ShapeString(shape)));
    }
    return t;
  }

  absl::StatusOr<Tensor> Upload(std::span<const float> values, Shape shape) const {
    return kernels::UploadFloats(backend_, values, kernels::DType::kF32, std::move(shape));
  }

  // BF16 when every value is one (a tensor the checkpoint stores in BF16, read here as floats),
  // else F32: the same values either way, MatMul widening them to fp32 as it loads them, in
  // half the bytes where the checkpoint allows it.
  absl::StatusOr<Tensor> UploadExact(std::span<const float> values, Shape shape) const {
    const bool bf16 = std::all_of(values.begin(), values.end(), [](float v) {
      return kernels::ToFloat(kernels::ToBf16(v)) == v || v != v;
    });
    return kernels::UploadFloats(backend_, values, bf16 ? kernels::DType::kBF16 : kernels::DType::kF32,
                                 std::move(shape));
  }

  // A weight matrix only MatMul reads, stored as WeightsOptions::matrix_dtype: FP8 values are
  // quantized in 128 x 128 blocks here (values of an FP8 checkpoint, read as their dequantized
  // floats, come back to their stored bytes when the blocks line up).
  absl::StatusOr<Matrix> UploadMatrix(std::span<const float> values, Shape shape) const {
    if (matrix_dtype_ != kernels::DType::kF8E4M3) {
      return kernels::UploadFloats(backend_, values, matrix_dtype_, std::move(shape));
    }
    if (shape.rank() != 2) return absl::InternalError(absl::StrCat("an FP8 matrix of shape ", shape.ToString()));
    const int64_t rows = shape.dim(0), cols = shape.dim(1);
    ASSIGN_OR_RETURN(kernels::BlockScaledFp8 q, kernels::QuantizeBlockScaledFp8(values, rows, cols));
    ASSIGN_OR_RETURN(Tensor w, backend_.Allocate(kernels::DType::kF8E4M3, std::move(shape)));
    RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const kernels::F8E4M3>(q.values)), w));
    ASSIGN_OR_RETURN(Tensor scales, Upload(q.scale_inv, Shape{q.scale_rows, q.scale_cols}));
    return Matrix(std::move(w), std::move(scales));
  }

  // A vocabulary head, at HeadMatrixDType.
  absl::StatusOr<Tensor> UploadHead(std::span<const float> values, Shape shape) const {
    return kernels::UploadFloats(backend_, values, HeadMatrixDType(matrix_dtype_), std::move(shape));
  }

  // The absorbed attention matrices (w_uk, w_uv), at AbsorbedMatrixDType.
  absl::StatusOr<Tensor> UploadAbsorbed(std::span<const float> values, Shape shape) const {
    return kernels::UploadFloats(backend_, values, AbsorbedMatrixDType(matrix_dtype_), std::move(shape));
  }

  // A whole tensor, replicated.
  absl::StatusOr<Tensor> Replicated(const std::string& name, std::vector<int64_t> shape) const {
    ASSIGN_OR_RETURN(FloatTensor t, Read(name, shape));
    return Upload(t.values, Shape(shape));
  }
  absl::StatusOr<Matrix> ReplicatedMatrix(const std::string& name, std::vector<int64_t> shape) const {
    ASSIGN_OR_RETURN(FloatTensor t, Read(name, shape));
    return UploadMatrix(t.values, Shape(shape));
  }

 private:
  const Checkpoint& checkpoint_;
  Backend& backend_;
  const kernels::DType matrix_dtype_;
};

// Rows [begin, begin + count) of a row-major [rows, cols] matrix.
std::vector<float> Rows(const FloatTensor& t, int64_t begin, int64_t count) {
  const int64_t cols = t.shape[1];
  return std::vector<float>(t.values.begin() + begin * cols, t.values.begin() + (begin + count) * cols);
}

// Columns [begin, begin + count) of a row-major [rows, cols] matrix.
std::vector<float> Cols(const FloatTensor& t, int64_t begin, int64_t count) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  std::vector<float> out;
  out.reserve(static_cast<size_t>(rows * count));
  for (int64_t r = 0; r < rows; ++r) {
    out.insert(out.end(), t.values.begin() + r * cols + begin, t.values.begin() + r * cols + begin + count);
  }
  return out;
}

absl::Status CheckDivides(const char* what, int64_t n, int world) {
  if (n % world != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", n, ") does not divide by the tensor-parallel size ", world));
  }
  return absl::OkStatus();
}

absl::StatusOr<MlpWeights> LoadMlp(const HostLoader& io, const std::string& prefix, int64_t D, int64_t I,
                                   TensorParallel tp) {
  RETURN_IF_ERROR(CheckDivides("MLP intermediate size", I, tp.world_size));
  const int64_t Ir = I / tp.world_size, begin = tp.rank * Ir;
  ASSIGN_OR_RETURN(FloatTensor gate, io.Read(prefix + "gate_proj.weight", {I, D}));
  ASSIGN_OR_RETURN(FloatTensor up, io.Read(prefix + "up_proj.weight", {I, D}));
  ASSIGN_OR_RETURN(FloatTensor down, io.Read(prefix + "down_proj.weight", {D, I}));
  std::vector<float> gate_up = Rows(gate, begin, Ir);
  std::vector<float> up_rows = Rows(up, begin, Ir);
  gate_up.insert(gate_up.end(), up_rows.begin(), up_rows.end());
  MlpWeights mlp;
  ASSIGN_OR_RETURN(mlp.gate_up, io.UploadMatrix(gate_up, Shape{2 * Ir, D}));
  ASSIGN_OR_RETURN(mlp.down, io.UploadMatrix(Cols(down, begin, Ir), Shape{D, Ir}));
  return mlp;
}

absl::StatusOr<AttentionWeights> LoadAttention(const HostLoader& io, const ModelConfig& c,
                                               const std::string& p, bool with_indexer,
                                               TensorParallel tp) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dn = c.qk_nope_head_dim,
                dr = c.qk_rope_head_dim, dv = c.v_head_dim, kv = c.kv_lora_rank;
  RETURN_IF_ERROR(CheckDivides("num_attention_heads", H, tp.world_size));
  const int64_t Hr = H / tp.world_size, h0 = tp.rank * Hr;
  AttentionWeights a;

  // Queries: split each head's rows of q_b_proj (or q_proj) into its nope and rope parts.
  const int64_t q_in = c.HasQLora() ? c.q_lora_rank : D;
  FloatTensor q;
  if (c.HasQLora()) {
    ASSIGN_OR_RETURN(a.q_a, io.ReplicatedMatrix(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, D}));
    ASSIGN_OR_RETURN(a.q_a_norm, io.Replicated(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank}));
    ASSIGN_OR_RETURN(q, io.Read(p + "self_attn.q_b_proj.weight", {H * c.QkHeadDim(), q_in}));
  } else {
    ASSIGN_OR_RETURN(q, io.Read(p + "self_attn.q_proj.weight", {H * c.QkHeadDim(), q_in}));
  }
  std::vector<float> q_nope, q_pe;
  for (int64_t h = h0; h < h0 + Hr; ++h) {
    std::vector<float> nope = Rows(q, h * c.QkHeadDim(), dn), pe = Rows(q, h * c.QkHeadDim() + dn, dr);
    q_nope.insert(q_nope.end(), nope.begin(), nope.end());
    q_pe.insert(q_pe.end(), pe.begin(), pe.end());
  }
  ASSIGN_OR_RETURN(a.q_nope, io.UploadMatrix(q_nope, Shape{Hr * dn, q_in}));
  ASSIGN_OR_RETURN(a.q_pe, io.UploadMatrix(q_pe, Shape{Hr * dr, q_in}));

  // Keys and values: the latent and the shared rope key come from one projection.
  ASSIGN_OR_RETURN(FloatTensor kv_a, io.Read(p + "self_attn.kv_a_proj_with_mqa.weight", {kv + dr, D}));
  ASSIGN_OR_RETURN(a.kv_a, io.UploadMatrix(Rows(kv_a, 0, kv), Shape{kv, D}));
  ASSIGN_OR_RETURN(a.k_pe_proj, io.UploadMatrix(Rows(kv_a, kv, dr), Shape{dr, D}));
  ASSIGN_OR_RETURN(a.kv_a_norm, io.Replicated(p + "self_attn.kv_a_layernorm.weight", {kv}));
  // kv_b_proj rows per head: dn rows of k_nope, then dv rows of v, each over the latent.
  ASSIGN_OR_RETURN(FloatTensor kv_b, io.Read(p + "self_attn.kv_b_proj.weight", {H * (dn + dv), kv}));
  std::vector<float> w_uk, w_uv;
  for (int64_t h = h0; h < h0 + Hr; ++h) {
    std::vector<float> k = Rows(kv_b, h * (dn + dv), dn), v = Rows(kv_b, h * (dn + dv) + dn, dv);
    w_uk.insert(w_uk.end(), k.begin(), k.end());
    w_uv.insert(w_uv.end(), v.begin(), v.end());
  }
  ASSIGN_OR_RETURN(a.w_uk, io.UploadAbsorbed(w_uk, Shape{Hr, dn, kv}));
  ASSIGN_OR_RETURN(a.w_uv, io.UploadAbsorbed(w_uv, Shape{Hr, dv, kv}));
  ASSIGN_OR_RETURN(FloatTensor o, io.Read(p + "self_attn.o_proj.weight", {D, H * dv}));
  ASSIGN_OR_RETURN(a.o_proj, io.UploadMatrix(Cols(o, h0 * dv, Hr * dv), Shape{D, Hr * dv}));

  if (with_indexer) {
    const IndexerConfig& ix = c.indexer;
    const std::string q_prefix = p + "self_attn.indexer.";
    IndexerWeights w;
    ASSIGN_OR_RETURN(w.wq_b, io.ReplicatedMatrix(q_prefix + "wq_b.weight", {ix.n_heads * ix.head_dim, c.q_lora_rank}));
    ASSIGN_OR_RETURN(w.wk, io.ReplicatedMatrix(q_prefix + "wk.weight", {ix.head_dim, D}));
    ASSIGN_OR_RETURN(w.k_norm_weight, io.Replicated(q_prefix + "k_norm.weight", {ix.head_dim}));
    ASSIGN_OR_RETURN(w.k_norm_bias, io.Replicated(q_prefix + "k_norm.bias", {ix.head_dim}));
    // Score scales fold into the head weights: w_h * relu(q.k * Di^-0.5) with
    // w = weights_proj(x) * Hi^-0.5 equals (w * Hi^-0.5 * Di^-0.5) * relu(q.k).
    ASSIGN_OR_RETURN(FloatTensor head_weights, io.Read(q_prefix + "weights_proj.weight", {ix.n_heads, D}));
    const float scale = static_cast<float>(ix.HeadWeightScale() * ix.ScoreScale());
    for (float& v : head_weights.values) v *= scale;
    ASSIGN_OR_RETURN(w.weights_proj, io.UploadMatrix(head_weights.values, Shape{ix.n_heads, D}));
    a.indexer = std::move(w);
  }
  return a;
}

absl::StatusOr<MoeWeights> LoadMoe(const HostLoader& io, const ModelConfig& c, const std::string& p,
                                   TensorParallel tp, bool routed_experts) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts;
  MoeWeights moe;
  ASSIGN_OR_RETURN(FloatTensor router, io.Read(p + "mlp.gate.weight", {E, D}));
  ASSIGN_OR_RETURN(FloatTensor bias, io.Read(p + "mlp.gate.e_score_correction_bias", {E}));
  // Checkpoints store the router in BF16 (GLM-5's, DeepSeek-V3's, FP8 ones too); its logits are
  // fp32 sums either way, so it keeps those values in half the bytes (3.1 MB a GLM-5 layer, not
  // 6.3: the router GEMV is on every MoE layer's critical path).
  ASSIGN_OR_RETURN(moe.router_device, io.UploadExact(router.values, Shape{E, D}));
  ASSIGN_OR_RETURN(moe.bias_device, io.Upload(bias.values, Shape{E}));
  moe.router = std::move(router.values);
  moe.bias = std::move(bias.values);
  moe.experts.reserve(routed_experts ? static_cast<size_t>(E) : 0);
  for (int64_t e = 0; routed_experts && e < E; ++e) {
    ASSIGN_OR_RETURN(MlpWeights expert,
                     LoadMlp(io, absl::StrCat(p, "mlp.experts.", e, "."), D, c.moe_intermediate_size, tp));
    moe.experts.push_back(std::move(expert));
  }
  if (c.n_shared_experts > 0) {
    ASSIGN_OR_RETURN(moe.shared, LoadMlp(io, p + "mlp.shared_experts.", D,
                                         c.moe_intermediate_size * c.n_shared_experts, tp));
  }
  return moe;
}

absl::StatusOr<LayerWeights> LoadLayer(const HostLoader& io, const ModelConfig& c, int64_t layer,
                                       TensorParallel tp, bool routed_experts) {
  const std::string p = LayerPrefix(layer);
  const int64_t D = c.hidden_size;
  const bool mtp = layer >= c.num_hidden_layers;
  LayerWeights w;
  ASSIGN_OR_RETURN(w.input_norm, io.Replicated(p + "input_layernorm.weight", {D}));
  ASSIGN_OR_RETURN(w.post_attention_norm, io.Replicated(p + "post_attention_layernorm.weight", {D}));
  const bool indexer = c.indexer.enabled && (mtp || c.indexer.kinds[layer] == IndexerKind::kFull);
  ASSIGN_OR_RETURN(w.attention, LoadAttention(io, c, p, indexer, tp));
  if (c.IsMoeLayer(layer)) {
    ASSIGN_OR_RETURN(w.moe, LoadMoe(io, c, p, tp, routed_experts));
  } else {
    ASSIGN_OR_RETURN(w.dense, LoadMlp(io, p + "mlp.", D, c.intermediate_size, tp));
  }
  return w;
}

// Vocabulary rows of this rank from a [V, D] head.
absl::StatusOr<Tensor> LoadHead(const HostLoader& io, const std::string& name, const ModelConfig& c,
                                TensorParallel tp) {
  RETURN_IF_ERROR(CheckDivides("vocab_size", c.vocab_size, tp.world_size));
  const int64_t Vr = c.vocab_size / tp.world_size;
  ASSIGN_OR_RETURN(FloatTensor head, io.Read(name, {c.vocab_size, c.hidden_size}));
  return io.UploadHead(Rows(head, tp.rank * Vr, Vr), Shape{Vr, c.hidden_size});
}

// A description of the config's MTP layers when the checkpoint holds no tensor of any of
// them, else "". Only all-absent counts: a partial MTP layer is a broken file, not a dropped
// layer, and fails on its first missing tensor.
std::string AbsentMtpLayers(const Checkpoint& checkpoint, const ModelConfig& c) {
  if (c.num_nextn_predict_layers == 0) return "";
  const std::vector<std::string> names = checkpoint.Names();
  for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
    const std::string prefix = LayerPrefix(c.num_hidden_layers + i);
    for (const std::string& name : names) {
      if (absl::StartsWith(name, prefix)) return "";
    }
  }
  return absl::StrCat("config.json names ", c.num_nextn_predict_layers, " MTP layer(s) (num_nextn_predict_layers) "
                      "but the checkpoint has no ", LayerPrefix(c.num_hidden_layers), "* tensor");
}

}  // namespace

absl::Status MatMul(kernels::Backend& backend, const kernels::Tensor& x, const Matrix& m, kernels::Tensor& y) {
  if (m.scale_inv.valid()) return backend.MatMulBlockScaled(x, m.w, m.scale_inv, y);
  return backend.MatMul(x, m.w, y);
}

absl::StatusOr<kernels::DType> ParseWeightDType(absl::string_view name) {
  if (name == "f32") return kernels::DType::kF32;
  if (name == "bf16") return kernels::DType::kBF16;
  if (name == "fp8") return kernels::DType::kF8E4M3;
  return absl::InvalidArgumentError(absl::StrCat("weight dtype \"", name, "\" is not one of f32, bf16, fp8"));
}

absl::StatusOr<ModelWeights> LoadModelWeights(const Checkpoint& checkpoint, const ModelConfig& config,
                                              kernels::Backend& backend, TensorParallel tp, WeightsOptions options) {
  if (tp.world_size < 1 || tp.rank < 0 || tp.rank >= tp.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", tp.rank, " of world size ", tp.world_size));
  }
  if (config.attention_bias) {
    return absl::UnimplementedError("attention_bias = true is not supported (no GLM-5 or DeepSeek-V3 model uses it)");
  }
  if (options.matrix_dtype != kernels::DType::kF32 && options.matrix_dtype != kernels::DType::kBF16 &&
      options.matrix_dtype != kernels::DType::kF8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("weight matrices are stored as F32, BF16 or F8_E4M3, not ",
                                                   kernels::DTypeName(options.matrix_dtype)));
  }
  const HostLoader io(checkpoint, backend, options.matrix_dtype);
  const int64_t D = config.hidden_size;
  ModelWeights w;
  w.vocab_rows_per_rank = config.vocab_size / tp.world_size;
  ASSIGN_OR_RETURN(w.embed, io.Replicated("model.embed_tokens.weight", {config.vocab_size, D}));
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    ASSIGN_OR_RETURN(LayerWeights lw, LoadLayer(io, config, layer, tp, options.routed_experts));
    w.layers.push_back(std::move(lw));
  }
  ASSIGN_OR_RETURN(w.final_norm, io.Replicated("model.norm.weight", {D}));
  ASSIGN_OR_RETURN(w.lm_head, LoadHead(io, config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight",
                                       config, tp));
  if (const std::string absent = AbsentMtpLayers(checkpoint, config); !absent.empty()) {
    w.mtp_missing = absent;
    return w;
  }
  for (int64_t i = 0; i < config.num_nextn_predict_layers; ++i) {
    const int64_t layer = config.num_hidden_layers + i;
    const std::string p = LayerPrefix(layer);
    MtpWeights m;
    ASSIGN_OR_RETURN(m.enorm, io.Replicated(p + "enorm.weight", {D}));
    ASSIGN_OR_RETURN(m.hnorm, io.Replicated(p + "hnorm.weight", {D}));
    // eh_proj acts on concat(enorm(embedding), hnorm(hidden)) (DeepSeek-V3 MTP, vLLM): its
    // first D columns take the embedding, the last D the hidden state.
    ASSIGN_OR_RETURN(FloatTensor eh, io.Read(p + "eh_proj.weight", {D, 2 * D}));
    ASSIGN_OR_RETURN(m.eh_embed, io.UploadMatrix(Cols(eh, 0, D), Shape{D, D}));
    ASSIGN_OR_RETURN(m.eh_hidden, io.UploadMatrix(Cols(eh, D, D), Shape{D, D}));
    ASSIGN_OR_RETURN(m.head_norm, io.Replicated(p + "shared_head.norm.weight", {D}));
    ASSIGN_OR_RETURN(m.head, LoadHead(io, p + "shared_head.head.weight", config, tp));
    ASSIGN_OR_RETURN(m.block, LoadLayer(io, config, layer, tp, options.routed_experts));
    w.mtp.push_back(std::move(m));
  }
  return w;
}

}  // namespace nq::model
