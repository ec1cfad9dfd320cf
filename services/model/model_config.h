// The model's config.json (HF transformers format) for the two architectures NestQuant
// Serve runs: GLM-5 (`GlmMoeDsaForCausalLM`, MLA + DSA indexer + MoE) and DeepSeek-V3
// (`DeepseekV3ForCausalLM`, MLA + MoE; also Kimi-K2 and other checkpoints that declare it).
//
// ParseModelConfig reads every key the forward pass needs, applies the defaults of the HF
// config classes (DeepseekV3Config, GlmMoeDsaConfig) where the key is optional, and refuses
// anything it cannot serve with a precise status:
//   UNIMPLEMENTED     an architecture, rope type, activation, routing or quantization method
//                     that is valid elsewhere but not here (the message lists what is);
//   INVALID_ARGUMENT  malformed JSON (with line/column), a missing required key, a value of
//                     the wrong JSON type, or out-of-range / inconsistent values.
// Keys that shape tensors (sizes, head dims, expert counts, q_lora_rank) are required: a
// silent HF default there (hidden_size = 7168, ...) would only fail later at weight load.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/model/rope_config.h"

namespace nq::model {

enum class Architecture {
  kGlmMoeDsa,   // "GlmMoeDsaForCausalLM"
  kDeepseekV3,  // "DeepseekV3ForCausalLM"
};

// The HF class name, e.g. "GlmMoeDsaForCausalLM".
absl::string_view ArchitectureName(Architecture architecture);
// The HF model_type written for the architecture: "glm_moe_dsa" / "deepseek_v3".
absl::string_view DefaultModelType(Architecture architecture);

enum class MlpKind {
  kDense,  // mlp_layer_types "dense": gate/up/down with intermediate_size
  kMoe,    // mlp_layer_types "sparse": router + routed experts + shared experts
};

enum class IndexerKind {
  kFull,    // "full": the layer runs the DSA indexer
  kShared,  // "shared": the layer reuses the top-k selection of the last full layer before it
};

// Only values the CPU and CUDA backends implement are representable.
enum class ScoringFunc { kSigmoid };  // "sigmoid"
enum class TopkMethod { kNoauxTc };   // "noaux_tc": sigmoid + correction bias, group-limited
enum class Activation { kSilu };      // "silu"

// DeepSeek Sparse Attention indexer (GlmMoeDsa only; disabled for DeepseekV3).
struct IndexerConfig {
  bool enabled = false;
  int64_t topk = 0;      // index_topk: tokens each query attends to
  int64_t head_dim = 0;  // index_head_dim; its first qk_rope_head_dim dims carry RoPE
  int64_t n_heads = 0;   // index_n_heads
  // indexer_rope_interleave: GPT-J (interleaved) rather than NeoX (split-half) RoPE in the
  // indexer. GLM-5 sets true; absent means false, as vLLM reads it.
  bool rope_interleave = false;
  // index_share_for_mtp_iteration (GLM-5.2): MTP draft steps reuse the indexer selection.
  bool share_for_mtp_iteration = false;
  std::vector<IndexerKind> kinds;  // one per decoder layer; kinds[0] is kFull

  // The layer whose top-k selection `layer` attends with: itself when full, otherwise the
  // nearest full layer before it. Layers past `kinds` (MTP) use their own.
  int64_t SelectionSourceLayer(int64_t layer) const;
  // index_head_dim^-0.5, the scale of the q.k scores (HF GlmMoeDsaIndexer.softmax_scale).
  double ScoreScale() const;
  // index_n_heads^-0.5, folded into the per-head weights (HF GlmMoeDsaIndexer).
  double HeadWeightScale() const;

  bool operator==(const IndexerConfig&) const = default;
};

// Elements per block scale of NVFP4 (ModelOpt's group_size; kernels::kNvfp4BlockSize).
inline constexpr int64_t kNvfp4GroupSize = 16;

enum class QuantMethod {
  kFp8,            // "fp8": DeepSeek block-wise FP8 (weight_scale_inv)
  kModeloptNvfp4,  // "modelopt" with quant_algo "NVFP4": ModelOpt's NVFP4 (services/nvfp4/)
};

// quantization_config of an FP8 checkpoint (DeepSeek-V3, GLM-5-FP8) or of an NVFP4 one as
// NVIDIA ModelOpt writes it (quant_method "modelopt", quant_algo "NVFP4", group_size 16; the
// fmt / activation / block fields below then keep their defaults and are not written back).
struct QuantizationConfig {
  QuantMethod method = QuantMethod::kFp8;
  std::string fmt = "e4m3";                   // the only format those checkpoints use
  std::string activation_scheme = "dynamic";  // the only scheme HF's FineGrainedFP8 accepts
  int64_t weight_block_rows = 128;            // weight_block_size[0]: output rows per scale
  int64_t weight_block_cols = 128;            // weight_block_size[1]: input columns per scale
  // Modules stored unquantized (GLM-5-FP8 lists norms, the router gate, the indexer's
  // weights_proj, ...; ModelOpt calls the list exclude_modules). Absent and empty are kept
  // apart so the config writes back as read.
  std::optional<std::vector<std::string>> modules_to_not_convert;

  // Whether `module` (e.g. "model.layers.3.mlp.gate") is listed, itself or a module above
  // it on a '.' boundary, in modules_to_not_convert.
  bool IsNotConverted(absl::string_view module) const;

  bool operator==(const QuantizationConfig&) const = default;
};

struct ModelConfig {
  Architecture architecture = Architecture::kDeepseekV3;
  std::string model_type;  // as read ("kimi_k2" declares DeepseekV3ForCausalLM too)

  // Sizes (required).
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each routed expert, and each shared expert
  int64_t num_hidden_layers = 0;      // decoder layers, MTP layers not included
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // MLA: always == num_attention_heads

  // Multi-head latent attention.
  int64_t q_lora_rank = 0;  // 0 (config null): a plain q_proj, as in DeepSeek-V2-Lite
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;  // the rotary width; even
  int64_t v_head_dim = 0;
  bool attention_bias = false;  // bias on q_a_proj / kv_a_proj_with_mqa / o_proj

  // Mixture of experts.
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 0;     // expert groups; n_routed_experts % n_group == 0
  int64_t topk_group = 0;  // groups a token may route into
  double routed_scaling_factor = 0.0;
  bool norm_topk_prob = true;
  ScoringFunc scoring_func = ScoringFunc::kSigmoid;
  TopkMethod topk_method = TopkMethod::kNoauxTc;
  std::vector<MlpKind> mlp_kinds;  // one per decoder layer

  // Everything else the forward pass reads.
  Activation hidden_act = Activation::kSilu;
  double rms_norm_eps = 0.0;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // eos_token_id, an int or a list in config.json
  std::optional<int64_t> pad_token_id;
  RopeConfig rope;
  // rope_interleave: the MLA rope slice is rotated GPT-J style (pairs 2i, 2i+1) rather
  // than NeoX style (i, i + d/2). HF DeepseekV3Config defaults to true.
  bool rope_interleave = true;
  IndexerConfig indexer;
  int64_t num_nextn_predict_layers = 0;            // MTP layers stored after the decoder layers
  std::optional<QuantizationConfig> quantization;  // absent: weights in `dtype`
  std::string dtype;  // "dtype" / "torch_dtype": "bfloat16", "float16", "float32" or empty

  // q_lora_rank > 0: q_a_proj -> q_a_layernorm -> q_b_proj, else q_proj.
  bool HasQLora() const { return q_lora_rank > 0; }
  // qk_nope_head_dim + qk_rope_head_dim.
  int64_t QkHeadDim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Whether `layer` has an MoE block. Layers num_hidden_layers .. + num_nextn_predict_layers
  // - 1 are the MTP layers, MoE in both architectures; anything past them is not a layer.
  bool IsMoeLayer(int64_t layer) const;
  // Number of leading dense layers (config.json first_k_dense_replace).
  int64_t FirstKDenseReplace() const;

  // RoPE inverse frequencies for the qk_rope_head_dim slice (qk_rope_head_dim / 2 values).
  std::vector<double> RopeInvFreq() const { return rope.InvFreq(qk_rope_head_dim); }
  // Factor applied to cos and sin (HF rotary embedding `attention_scaling`).
  double AttentionScaling() const { return rope.AttentionFactor(); }
  // Softmax scale of MLA attention, as HF sets `self.scaling`: QkHeadDim()^-0.5, times
  // mscale(factor, mscale_all_dim)^2 with YaRN (both architectures, docs/model_math.md 5.2).
  double SoftmaxScale() const;

  // INVALID_ARGUMENT / UNIMPLEMENTED naming the first rule the config breaks. ParseModelConfig
  // runs it; run it on a config built in code before ToJson.
  absl::Status Validate() const;

  // An HF-compatible config.json (transformers 5 layout: rope_parameters with rope_theta
  // inside, plus rope_theta and, for YaRN, rope_scaling for older readers). Parsing it
  // gives back an equal ModelConfig. Requires Validate().ok().
  std::string ToJson() const;

  bool operator==(const ModelConfig&) const = default;
};

// Parses config.json text. See the file comment for the status codes.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text);

// Reads and parses `model_dir`/config.json; every error names that file.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace nq::model
