// The weights one tensor-parallel rank holds, on its backend, already cut and rearranged for
// the graph (services/model/model.h):
//  - attention heads are split across ranks: rank r holds heads [r*H/W, (r+1)*H/W) of
//    q_b_proj, kv_b_proj and the matching columns of o_proj (row-parallel);
//  - the dense MLP, the shared experts and every routed expert are split on their
//    intermediate dimension (gate/up rows, down columns), so each rank holds a slice of every
//    expert (DESIGN.md "Tensor parallelism");
//  - norms, the router, the DSA indexer, embeddings and the latent projections are
//    replicated (they are small, and the indexer's selection must agree on every rank);
//  - lm_head is split by vocabulary rows and all-gathered.
// Load-time splits replace slicing at run time: kv_a_proj_with_mqa becomes kv_a (latent) and
// k_pe_proj (rope key); q_b_proj becomes its nope and rope rows; kv_b_proj becomes the
// per-head absorbed matrices w_uk [H, dn, c] and w_uv [H, dv, c]; gate and up are stacked
// into one [2I, D] matrix for SiluAndMul.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/nq_moe.h"
#include "kernels/nvfp4_moe.h"
#include "services/model/model_config.h"
#include "services/model/safetensors.h"

namespace nq::model {

struct TensorParallel {
  int rank = 0;
  int world_size = 1;
};

// A weight matrix only MatMul reads, as WeightsOptions::matrix_dtype stores it: F32 or BF16
// values, or FP8 E4M3 values with their 128 x 128 block scales (Backend::MatMulBlockScaled).
struct Matrix {
  kernels::Tensor w;          // [n, k]
  kernels::Tensor scale_inv;  // F32 [ceil(n / 128), ceil(k / 128)] for F8_E4M3 w; empty otherwise

  Matrix() = default;
  Matrix(kernels::Tensor values) : w(std::move(values)) {}  // NOLINT: a plain matrix is its values
  Matrix(kernels::Tensor values, kernels::Tensor scales) : w(std::move(values)), scale_inv(std::move(scales)) {}

  const kernels::Shape& shape() const { return w.shape(); }
  kernels::DType dtype() const { return w.dtype(); }
  bool valid() const { return w.valid(); }
  std::size_t nbytes() const { return w.nbytes() + scale_inv.nbytes(); }
  kernels::Backend::WeightRef Ref() const { return {&w, scale_inv.valid() ? &scale_inv : nullptr}; }
};

// y = x · m^T through MatMul or, for FP8 values, MatMulBlockScaled.
absl::Status MatMul(kernels::Backend& backend, const kernels::Tensor& x, const Matrix& m, kernels::Tensor& y);

struct MlpWeights {
  Matrix gate_up;  // [2 * I_r, D]: gate rows, then up rows
  Matrix down;     // [D, I_r]
};

struct IndexerWeights {
  Matrix wq_b;                    // [Hi * Di, q_lora]
  Matrix wk;                      // [Di, D]
  kernels::Tensor k_norm_weight;  // [Di]
  kernels::Tensor k_norm_bias;    // [Di]
  Matrix weights_proj;            // [Hi, D]
};

struct AttentionWeights {
  // With q_lora_rank: q_a [ql, D] and its norm; q_nope / q_pe take the normed latent.
  // Without: q_nope / q_pe take the hidden state directly.
  std::optional<Matrix> q_a;
  std::optional<kernels::Tensor> q_a_norm;
  Matrix q_nope;              // [H_r * dn, ql or D]
  Matrix q_pe;                // [H_r * dr, ql or D]
  Matrix kv_a;                // [c, D]
  Matrix k_pe_proj;           // [dr, D]
  kernels::Tensor kv_a_norm;  // [c]
  kernels::Tensor w_uk;       // [H_r, dn, c]
  kernels::Tensor w_uv;       // [H_r, dv, c]
  Matrix o_proj;              // [D, H_r * dv]
  std::optional<IndexerWeights> indexer;
};

// Every routed expert of a layer as a NestQuant release holds it (kernels/nq_moe.h): packed
// 2-bit base codes, scales and level tables; 4-bit residuals are read in place from a slot.
struct PackedExperts {
  kernels::NqMoeWeights weights;
  // Residual records this layer keeps itself (nq logits / nq kld at 4 bits or the fixed set):
  // slot s of `records` is record_bytes long; static_slots[e] is expert e's slot or -1. Empty
  // when the records come from a worker's slot arena (Model::SetSlotArena).
  kernels::Tensor records;
  std::int64_t record_bytes = 0;
  std::vector<std::int32_t> static_slots;  // [E]; empty = every expert at 2 bits
  // Bytes of the packed planes, scales and tables (records counted apart).
  std::int64_t packed_bytes = 0;
};

// Every routed expert of a layer as an NVFP4 checkpoint holds it (kernels/nvfp4_moe.h): packed
// E2M1 codes, E4M3 block scales and one global scale per expert and projection, this rank's
// slice, gate and up fused under one global (services/nvfp4/served_experts.h).
struct Nvfp4Experts {
  kernels::Nvfp4MoeWeights weights;
  std::int64_t bytes = 0;  // of the codes and scales on the backend
};

struct MoeWeights {
  std::vector<float> router;  // [E, D], on the host (host routing: model.h, Route)
  std::vector<float> bias;    // [E] e_score_correction_bias
  kernels::Tensor router_device;  // the same [E, D] on the backend, for the logits matmul: BF16
                                  // when the checkpoint's values are, else F32 (the same values)
  kernels::Tensor bias_device;    // the same [E] on the backend (Backend::MoeRoute)
  // Dense routed experts (a checkpoint served as it is). Empty when `packed` or `nvfp4` is set;
  // at most one of those two is. An NVFP4 layer routes on the host (Model::RoutesOnBackend).
  std::vector<MlpWeights> experts;
  std::optional<PackedExperts> packed;
  std::optional<Nvfp4Experts> nvfp4;
  std::optional<MlpWeights> shared;
};

struct LayerWeights {
  kernels::Tensor input_norm;  // [D]
  kernels::Tensor post_attention_norm;  // [D]
  AttentionWeights attention;
  std::optional<MlpWeights> dense;
  std::optional<MoeWeights> moe;
};

// The extra weights of an MTP layer (the decoder block itself is a LayerWeights).
struct MtpWeights {
  kernels::Tensor enorm;  // [D]
  kernels::Tensor hnorm;  // [D]
  Matrix eh_embed;   // [D, D]: eh_proj columns applied to enorm(embedding)
  Matrix eh_hidden;  // [D, D]: eh_proj columns applied to hnorm(hidden)
  kernels::Tensor head_norm;  // [D]
  kernels::Tensor head;       // [V_r, D], vocabulary rows of this rank
  LayerWeights block;
};

struct ModelWeights {
  kernels::Tensor embed;       // [V, D], replicated
  std::vector<LayerWeights> layers;
  kernels::Tensor final_norm;  // [D]
  kernels::Tensor lm_head;     // [V_r, D], vocabulary rows of this rank
  int64_t vocab_rows_per_rank = 0;
  // One entry per config MTP layer, or none when the checkpoint ships without them (see
  // mtp_missing).
  std::vector<MtpWeights> mtp;
  // Why `mtp` is empty although the config names MTP layers (transformers' save_pretrained and
  // many fine-tunes drop them); empty otherwise. The model then serves without drafts.
  std::string mtp_missing;
};

// Loads and shards every weight of `config` from `checkpoint` onto `backend` as F32 (weight
// matrices as WeightsOptions::matrix_dtype)
// (F8_E4M3 weights are dequantized with their 128x128 block scales). Errors name the tensor:
// NOT_FOUND for a missing one, INVALID_ARGUMENT for a wrong shape or a split that does not
// divide (heads, intermediate sizes and vocabulary must divide by the world size). A config
// that names MTP layers whose tensors are all absent loads without them (mtp_missing says so);
// an MTP layer with only some of its tensors is NOT_FOUND like any other missing tensor.
struct WeightsOptions {
  // false: the routed experts are not read (they come from a NestQuant release, which fills
  // MoeWeights::packed), so a checkpoint without expert weights loads.
  bool routed_experts = true;
  // Storage of the weight matrices only MatMul reads (projections, MLPs, heads): F32; BF16,
  // which halves their memory and the bytes a decode step reads, and is exact for the BF16
  // checkpoints models ship as; or F8_E4M3 with 128 x 128 block scales (kernels/fp8_block_quantize.h),
  // a quarter of F32: the matrices of an FP8 checkpoint come back to their stored bytes where
  // the loader's slices keep whole 128-row blocks, and a BF16 checkpoint's are quantized as
  // DeepSeek's FP8 checkpoints are. The vocabulary heads then stay BF16 (FP8 checkpoints keep
  // them BF16); AbsorbedMatrixDType says how w_uk and w_uv are stored. Norms and the embedding
  // stay F32; the router keeps its checkpoint values whatever this is, in BF16 when they all are
  // BF16 values (MoeWeights::router_device), else F32.
  kernels::DType matrix_dtype = kernels::DType::kF32;
};
// The --weight_dtype values: "f32", "bf16" or "fp8". INVALID_ARGUMENT names the accepted values.
absl::StatusOr<kernels::DType> ParseWeightDType(absl::string_view name);

absl::StatusOr<ModelWeights> LoadModelWeights(const Checkpoint& checkpoint, const ModelConfig& config,
                                              kernels::Backend& backend, TensorParallel tp,
                                              WeightsOptions options = {});

}  // namespace nq::model
