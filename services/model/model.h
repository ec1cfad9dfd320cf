// The GLM-5 (GlmMoeDsaForCausalLM) and DeepSeek-V3 (DeepseekV3ForCausalLM) forward pass of
// one tensor-parallel rank, on any backend (docs/model_math.md is the math it implements).
// The graph reads top to bottom as the layer stack: embed -> [MLA (+ DSA indexer) ->
// all-reduce -> dense MLP or MoE -> all-reduce] x N -> final norm -> lm_head (all-gather);
// the MTP layer runs beside it on the main model's final hidden states.
//
// One Model holds one sequence's KV cache. Forward() appends tokens at the cache's end, so a
// prompt of T tokens followed by T' single-token calls gives the logits of one prefill over
// T + T' tokens. Every rank of a world calls Forward with the same tokens; every rank gets the
// full logits.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/comm/communicator.h"
#include "services/model/kv_cache.h"
#include "services/model/model_config.h"
#include "services/model/model_weights.h"
#include "services/model/moe_routing.h"

namespace nq::model {

struct ModelOptions {
  // Tokens the KV cache holds (prompt + generated); 0 uses min(max_position_embeddings, 4096).
  int64_t max_tokens = 0;
  TensorParallel tp;
  // Storage of the KV cache's latent and rope key (KvCache): F32 (the reference; the default on
  // every backend until the BF16 cache has been measured on the served models) or BF16.
  kernels::DType kv_cache_dtype = kernels::DType::kF32;
  // Storage of the weight matrices (WeightsOptions::matrix_dtype): F32 or BF16.
  kernels::DType weight_dtype = kernels::DType::kF32;
};

class Model {
 public:
  // Loads config.json and the checkpoint (single or sharded, F32/BF16/F16/F8_E4M3) from
  // `model_dir` and shards the weights for options.tp. `comm` may be null when the world
  // size is 1; it must outlive the model.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& model_dir,
                                                     kernels::Backend& backend,
                                                     kernels::Communicator* comm,
                                                     ModelOptions options);
  static absl::StatusOr<std::unique_ptr<Model>> Create(ModelConfig config, ModelWeights weights,
                                                       kernels::Backend& backend,
                                                       kernels::Communicator* comm,
                                                       ModelOptions options);

  const ModelConfig& config() const { return config_; }

  // Runs `tokens` at positions [cache_length(), cache_length() + T) and returns their logits,
  // row-major [T, vocab_size], float32. INVALID_ARGUMENT for an empty input, a token id
  // >= vocab_size, or more tokens than the cache has room for.
  absl::StatusOr<std::vector<float>> Forward(std::span<const int32_t> tokens);
  // As Forward, but returns only the last token's logits [vocab_size] (serving: the head
  // runs on one row instead of the whole prompt).
  absl::StatusOr<std::vector<float>> ForwardLast(std::span<const int32_t> tokens);

  // The final-normed hidden states [T, hidden_size] of the last Forward: what MTP reads.
  const std::vector<float>& last_hidden() const { return last_hidden_; }

  // Whether the checkpoint's MTP layers were loaded (a config may name some that the files
  // lack: mtp_missing() then says why, and the model serves without drafts).
  bool has_mtp() const { return !weights_.mtp.empty(); }
  const std::string& mtp_missing() const { return weights_.mtp_missing; }

  // MTP layer `index`: entry i takes the embedding of next_tokens[i] and hidden row i (the
  // main model's final-normed state at the position before next_tokens[i]); entries append
  // to the MTP layer's own cache. Returns logits [T, vocab_size] predicting the token after
  // next_tokens[i]. FAILED_PRECONDITION when the checkpoint has no MTP layer.
  absl::StatusOr<std::vector<float>> ForwardMtp(std::span<const int32_t> next_tokens,
                                                std::span<const float> hidden, int index = 0);
  // As ForwardMtp, but returns only the last entry's logits [vocab_size] (drafting: a prefill's
  // worth of entries feeds the MTP cache, and only the last one drafts).
  absl::StatusOr<std::vector<float>> ForwardMtpLast(std::span<const int32_t> next_tokens,
                                                    std::span<const float> hidden, int index = 0);
  // The shared_head-normed MTP states [T, hidden_size] of the last ForwardMtp. Speculative
  // decoding feeds them back as `hidden` to draft further ahead: after shared_head.norm they
  // are the MTP layer's counterpart of the main model's final-normed state, which is what the
  // layer was trained to read.
  const std::vector<float>& last_mtp_hidden() const { return last_mtp_hidden_; }

  // Calibration (nq calibrate): sees the inputs of every routed expert as they run. `rows`
  // holds n x dim floats: the expert's gate/up input (dim = hidden_size) or, with down_input,
  // its down_proj input (dim = this rank's intermediate slice).
  struct ExpertActivations {
    int64_t layer = 0;
    int32_t expert = 0;
    bool down_input = false;
    int64_t dim = 0;
    std::span<const float> rows;
  };
  void SetExpertObserver(std::function<void(const ExpertActivations&)> observer) { observer_ = std::move(observer); }
  // Routing traces (nq trace): every MoE layer's routing of the tokens of each forward.
  void SetRoutingObserver(std::function<void(int64_t layer, const MoeRouting&)> observer) {
    routing_observer_ = std::move(observer);
  }

  // Serving a NestQuant release (MoeWeights::packed, kernels/nq_moe.h). `source(layer, expert,
  // tokens)` names the slot holding the expert's residual record, or -1 to run it at 2 bits;
  // called once per (layer, expert) that has tokens in a forward, on the forward's thread. The
  // slots index the slot arena of SetSlotArena when one is set, else the layer's own records
  // (PackedExperts::records). Without a source, each layer's PackedExperts::static_slots apply.
  using ExpertSlotSource = std::function<std::int32_t(int64_t layer, int32_t expert, int64_t tokens)>;
  void SetExpertSlotSource(ExpertSlotSource source) { slot_source_ = std::move(source); }
  // A worker's slot arena: model layer L's slot s starts at base + layer_offsets.at(L) +
  // s * slot_bytes. Memory of the backend's kind; it must outlive the model.
  struct SlotArena {
    const std::byte* base = nullptr;
    std::map<int64_t, uint64_t> layer_offsets;
    int64_t slot_bytes = 0;
    int64_t slots_per_layer = 0;
  };
  void SetSlotArena(SlotArena arena) { arena_ = std::move(arena); }
  // Bytes of routed-expert weights this model holds: packed codes, scales and level tables, plus
  // records its layers keep themselves (a worker's slot arena is counted by the worker).
  int64_t RoutedExpertBytes() const;

  int64_t cache_length() const { return cache_.length(); }
  kernels::DType kv_cache_dtype() const { return cache_.dtype(); }
  // Tokens the KV cache can hold: the context window of this model instance.
  int64_t max_tokens() const { return cache_.max_tokens(); }
  // Bytes of the KV cache (latent, rope keys, indexer keys of every cache layer).
  int64_t kv_cache_bytes() const { return cache_.bytes(); }
  int64_t mtp_cache_length() const { return mtp_length_; }
  // Forgets the sequence (the cache is reused; nothing is freed).
  void ResetCache();
  // Keeps the first `length` tokens of the cache (prefix reuse, and rolling back the
  // positions of rejected drafts); the MTP cache keeps at most as many. Nothing is erased: the
  // next forward overwrites the latent, rope key and indexer key rows past `length` before any
  // query can see them (attention and the indexer read positions < start + T only).
  absl::Status TruncateCache(int64_t length);
  // Keeps the first `length` entries of the MTP layer's cache (drafts of a rejected run).
  absl::Status TruncateMtpCache(int64_t length);

 private:
  Model(ModelConfig config, ModelWeights weights, kernels::Backend& backend,
        kernels::Communicator* comm, KvCache cache, ModelOptions options);

  // x [T, D] (the residual stream) through decoder block `layer` at `start_pos`; `cache_index`
  // selects the LayerCache (decoder layers first, then MTP layers).
  absl::Status RunLayer(const LayerWeights& w, int64_t layer, size_t cache_index, kernels::Tensor& x,
                        int64_t start_pos);
  absl::StatusOr<kernels::Tensor> Attention(const AttentionWeights& w, int64_t layer, size_t cache_index,
                                            const kernels::Tensor& xn, int64_t start_pos);
  // `down_input`, when set, receives the activations that enter down_proj (host copy).
  absl::StatusOr<kernels::Tensor> Mlp(const MlpWeights& w, const kernels::Tensor& xn,
                                      std::vector<float>* down_input = nullptr);
  absl::StatusOr<kernels::Tensor> Moe(const MoeWeights& w, int64_t layer, const kernels::Tensor& xn);
  // The routed experts of a release-served layer through Backend::NqMoe.
  absl::StatusOr<kernels::Tensor> PackedMoe(const PackedExperts& w, int64_t layer, const kernels::Tensor& xn,
                                            const MoeRouting& routing);
  // Norm, head (vocabulary rows of this rank) and all-gather into full logits.
  absl::StatusOr<std::vector<float>> Logits(const kernels::Tensor& hidden_normed, const kernels::Tensor& head);
  // The decoder stack over `tokens`; leaves the final-normed hidden states in `x`.
  absl::Status RunStack(std::span<const int32_t> tokens, kernels::Tensor& x);
  // MTP layer `index` over its entries; leaves the shared_head-normed states in `u`.
  absl::Status RunMtp(std::span<const int32_t> next_tokens, std::span<const float> hidden, int index,
                      kernels::Tensor& u);
  absl::Status AllReduce(kernels::Tensor& t);
  absl::StatusOr<kernels::Tensor> Zeros(kernels::Shape shape);

  const ModelConfig config_;
  const ModelWeights weights_;
  kernels::Backend& backend_;
  kernels::Communicator* const comm_;
  KvCache cache_;
  const ModelOptions options_;
  const std::vector<float> inv_freq_;  // RoPE frequencies in float32, as HF holds them
  const float attention_scaling_;
  const float softmax_scale_;
  std::vector<float> last_hidden_;
  std::vector<float> last_mtp_hidden_;
  int64_t mtp_length_ = 0;
  // DSA top-k of the last full indexer layer in the current forward (shared layers reuse it).
  std::optional<kernels::Tensor> selection_;
  std::function<void(const ExpertActivations&)> observer_;
  std::function<void(int64_t, const MoeRouting&)> routing_observer_;
  ExpertSlotSource slot_source_;
  std::optional<SlotArena> arena_;
  // The slot table each packed layer's NqMoe reads, written before each use (model layer id).
  std::map<int64_t, kernels::Tensor> slot_tables_;
};

}  // namespace nq::model
