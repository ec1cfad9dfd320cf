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
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
  // Decode steps (up to kMaxStepGraphTokens tokens) as captured graphs where the backend can
  // capture them (CUDA): see Model::StepGraphStats.
  bool step_graphs = true;
  // Independent ops of a layer on the backend's side stream (Backend::BeginSideWork): an MoE
  // layer's shared expert beside its routed experts, and the new keys' norms, rotations and cache
  // writes beside the query projection. Results are equal either way; off only to compare.
  bool side_streams = true;
  // Each block's residual added by the next norm's op (Backend::AddRmsNorm: one kernel on CUDA
  // where the Adds and the RmsNorm are two or three, each latency-bound) instead of by Adds of
  // its own. Results are bit-identical either way (checked on an H100: the kernel's tests, the
  // fixtures' model test and the GLM-5 slice's tokens); off only to compare.
  bool fused_residual_norm = true;
  // Tests: decode steps take the step-graph path on a backend that cannot capture (the CPU),
  // each step issuing the ops a capture would record, so the graph body (device positions, the
  // sharded head's gather, the host staging, the draw) is checked against op by op where it
  // can run. Serving leaves it off.
  bool uncaptured_step_graphs = false;
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

  // Serving's decode step with the draw where the logits are (kernels/sample_tokens.h): runs
  // `tokens` as Forward does and returns the id `params` picks from the last token's logits
  // (Backend::SampleTokens). As a step graph (SamplesOnDevice) the graph samples and hands the
  // host the id and the final states, never the logits; elsewhere the logits come to the host
  // and SampleRowHost picks the same id. INVALID_ARGUMENT as Forward, for parameters outside
  // their ranges (SampleParamsError), or when that row has no finite logit.
  // `logit_delta` (empty, or [vocab_size]: a request's logit_bias and penalties,
  // Sampler::DeviceDrawAdjusted) is added to the row before the draw, on the backend in a graph;
  // it needs one token (INVALID_ARGUMENT otherwise, or for another length).
  absl::StatusOr<int32_t> ForwardSampled(std::span<const int32_t> tokens, const kernels::SampleParams& params,
                                         std::span<const float> logit_delta = {});
  // Whether ForwardSampled of `tokens` tokens samples on the backend (a step graph applies).
  bool SamplesOnDevice(size_t tokens) const { return StepGraphApplies(tokens); }
  // As ForwardSampled, but token i's row draws with `rows[i]` (one entry: every row with it) and
  // all their ids come back: a verification of deterministic drafts (speculative decoding), where
  // only the ids cross to the host. Rows of a sampled verification need draws of their own (one
  // shared uniform would tie the rows' picks together): Sampler::DeviceDraws.
  absl::StatusOr<std::vector<int32_t>> ForwardSampledRows(std::span<const int32_t> tokens,
                                                          std::span<const kernels::SampleParams> rows);

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

  // Drafting without a host round trip between drafts (speculative decoding's hot path): MTP
  // layer `index` takes next_tokens / hidden as ForwardMtpLast does, then drafts `num_drafts`
  // tokens, each drawn on the backend from its row by `draw` (Backend::SampleTokens; drafting
  // is greedy: temperature 0) and fed to the next entry with that entry's shared_head-normed
  // state, as MtpDrafter does on the host. The logits never leave the backend, and the head
  // runs on each forward's last row only; on a GPU the whole chain is one captured graph per
  // (rows, drafts, bucket). The MTP cache grows by next_tokens.size() + num_drafts - 1 and
  // last_mtp_hidden() holds the last entry's state. A draft the backend could not draw (a row
  // without a finite logit) ends the drafts there.
  absl::StatusOr<std::vector<int32_t>> DraftOnDevice(std::span<const int32_t> next_tokens,
                                                     std::span<const float> hidden, int num_drafts,
                                                     const kernels::SampleParams& draw, int index = 0);
  // Whether DraftOnDevice can draft `drafts` tokens after `rows` entries (one rank, or a rank of a
  // group whose every rank makes the same call: the leader mirrors it; no lookahead observer, 1
  // to kMaxStepGraphTokens of each, an MTP layer `index`).
  bool DraftsOnDevice(size_t rows, int drafts, int index = 0) const;

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
  void SetExpertObserver(std::function<void(const ExpertActivations&)> observer) {
    observer_ = std::move(observer);
    step_graphs_.clear();
  }
  // Routing traces (nq trace): every MoE layer's routing of the tokens of each forward. Without
  // `mtp_layers` the MTP layers' forwards are not logged for it (a worker reports the decoder's
  // layers only: drafting then copies no routing out and computes no norms).
  void SetRoutingObserver(std::function<void(int64_t layer, const MoeRouting&)> observer, bool mtp_layers = true) {
    routing_observer_ = std::move(observer);
    observe_mtp_routing_ = mtp_layers;
    step_graphs_.clear();
  }
  // Gate lookahead (issue #21): after each layer L, the router of layer L + depth, when that is
  // an MoE layer, applied to L's output (the attention of the layers between skipped): the
  // experts it will likely route to, known `depth` layers before it runs. Host routing, for
  // measuring how early routing can be known (eval/gate_lookahead.h) and for the worker's hints
  // (services/worker/lookahead_reporter.h); null turns it off. `layer_ran(L)`, when given, is
  // called after every layer L of such a forward, before that layer's prediction. With a slot
  // mailbox and an observer, every MoE layer applies the mailbox again, so what the streamer
  // posted while the forward runs serves its later layers; layer_ran is then the last moment the
  // table layer L ran with can be read.
  void SetLookaheadObserver(int depth, std::function<void(int64_t target_layer, const MoeRouting& predicted)> observer,
                            std::function<void(int64_t layer)> layer_ran = nullptr) {
    lookahead_depth_ = depth;
    lookahead_observer_ = std::move(observer);
    lookahead_layer_ran_ = std::move(layer_ran);
    step_graphs_.clear();
  }

  // Serving a NestQuant release (MoeWeights::packed, kernels/nq_moe.h). `source(layer, expert,
  // tokens)` names the slot holding the expert's residual record, or -1 to run it at 2 bits;
  // called once per (layer, expert) that has tokens in a forward, on the forward's thread. The
  // slots index the slot arena of SetSlotArena when one is set, else the layer's own records
  // (PackedExperts::records). Without a source, each layer's PackedExperts::static_slots apply.
  using ExpertSlotSource = std::function<std::int32_t(int64_t layer, int32_t expert, int64_t tokens)>;
  void SetExpertSlotSource(ExpertSlotSource source) {
    slot_source_ = std::move(source);
    step_graphs_.clear();
  }
  // The serving form of a slot source: whole slot tables, which the model keeps on the backend so
  // a forward routes on the backend (Backend::MoeRoute) and never waits for the host between
  // layers. Before each forward the model compares generation() with the generation it last
  // uploaded and, when it differs, refills every packed layer's table with fill(layer, [E]:
  // each expert's slot or -1). After the forward, once its routing is on the host, count()
  // sees each packed layer's routing (per-call statistics) and then the routing observer.
  // Takes precedence over SetExpertSlotSource.
  struct ExpertSlotTables {
    std::function<uint64_t()> generation;
    std::function<void(int64_t layer, std::span<int32_t> slot_of_expert)> fill;
    std::function<void(int64_t layer, const MoeRouting& routing)> count;
  };
  void SetExpertSlotTables(ExpertSlotTables tables) {
    slot_table_source_ = std::move(tables);
    uploaded_generation_.reset();
    step_graphs_.clear();
  }
  // The slot mailbox (kernels/slot_mailbox.h, DESIGN.md section 4): `rows` spans every layer of
  // `layers` (packed MoE layers, in the mailbox's order), E entries each. Every forward applies it
  // once, as the first op of its first packed MoE block (captured steps included: one read of the
  // mailbox per step, not one per layer), and the table it writes alone decides those layers'
  // slots from then on (the table source's fill is no longer uploaded for them; its count still
  // runs after each forward; a layer-major prefill's own slots still take precedence). The row
  // holds addresses the backend reads (CUDA: the device's aliases of mapped host memory), which
  // must outlive the model. INVALID_ARGUMENT for a layer without packed experts or a row of
  // another size.
  absl::Status SetSlotMailbox(const kernels::SlotMailboxRow& rows, const std::vector<int64_t>& layers);
  // A worker's slot arena: model layer L's slot s starts at base + layer_offsets.at(L) +
  // s * slot_bytes. Memory of the backend's kind; it must outlive the model.
  struct SlotArena {
    const std::byte* base = nullptr;
    std::map<int64_t, uint64_t> layer_offsets;
    int64_t slot_bytes = 0;
    int64_t slots_per_layer = 0;
  };
  void SetSlotArena(SlotArena arena) {
    arena_ = std::move(arena);
    step_graphs_.clear();
  }
  // Bytes of routed-expert weights this model holds: packed codes, scales and level tables, plus
  // records its layers keep themselves (a worker's slot arena is counted by the worker).
  int64_t RoutedExpertBytes() const;
  // The roofline's numerator (nq bench-decode): bytes a one-token decode step at cache length
  // `context` must read, routed experts apart: every weight of the decoder stack and the head
  // once (one embedding row, no MTP layer), and the KV-cache rows attention reads (top-k of
  // them under DSA) plus the indexer keys a full indexer layer scores.
  int64_t DecodeStepBytes(int64_t context) const;
  // The routed-expert part for decoder layer `layer` running `experts` (repeats read once):
  // each expert's packed codes and scales, plus its residual record when a static slot holds it
  // (a checkpoint expert: its matrices; an NVFP4 expert: its codes, block scales and globals).
  int64_t RoutedExpertStepBytes(int64_t layer, std::span<const int32_t> experts) const;

  // --- Layer-major prefill (issue #23; services/model/layer_major_prefill.cc).
  // A long span of new tokens runs layer by layer: layer L processes every chunk of the span
  // (chunk c sees the keys chunks 0..c wrote at layer L) before layer L+1 starts, so a worker
  // can hold one layer's routed experts at 4 bits for the whole span and prefetch the next
  // layer's while this one computes. Every (layer, chunk) computation gets the inputs
  // token-order chunked prefill gives it, so the logits are those of Forward over the same
  // chunks at the same per-expert precision.
  //
  // The 4-bit residuals a layer's hook supplies for the prefill: slot s starts at
  // arena + s * slot_bytes (memory of the backend's kind), or, where slot_records is given, at
  // slot_records[s] (slots scattered over memory: a buffer's own, then records in room the free
  // KV cache lends, LendKvRoom); slot_of_expert[e] names expert e's slot or -1 (2 bits). The
  // memory must stay unchanged until the next hook call returns or the prefill ends.
  struct PrefillLayerSlots {
    const std::byte* arena = nullptr;  // with slot_records: may be null (then records[0] stands in)
    int64_t slot_bytes = 0;
    int64_t num_slots = 0;
    std::vector<int32_t> slot_of_expert;  // [n_routed_experts]
    std::vector<const std::byte*> slot_records;  // empty, or [num_slots] record addresses
  };
  struct LayerMajorOptions {
    // Tokens per chunk (> 0): the bound on per-chunk activations (attention, MoE); the residual
    // stream of the whole span [T, hidden] is kept between layers.
    int64_t chunk_tokens = 0;
    // Once per MoE layer of the decoder stack, after every chunk's attention and routing and
    // before any of its routed experts run; `chunks` holds the routing of each chunk in order.
    // Returns slots for a release-served layer (nullopt: the model's usual slot source). An
    // error stops the prefill.
    std::function<absl::StatusOr<std::optional<PrefillLayerSlots>>(int64_t layer, std::span<const MoeRouting> chunks)>
        before_moe;
    // Checked before every (layer, chunk): true stops the prefill with CANCELLED.
    std::function<bool()> cancelled;
  };
  // Runs `tokens` at [cache_length(), cache_length() + T) layer-major and returns the last
  // token's logits [vocab_size]; last_hidden() then holds all T final-normed states, and the
  // routing observer sees each MoE layer once, with the routing of all T tokens. On any error
  // (CANCELLED included) cache_length() is unchanged: the rows past it were written, but no
  // query reads them before a later forward overwrites them. INVALID_ARGUMENT as Forward, or
  // for chunk_tokens <= 0.
  absl::StatusOr<std::vector<float>> PrefillLayerMajor(std::span<const int32_t> tokens,
                                                       const LayerMajorOptions& options);

  // --- Room the free KV cache lends (issue #23's slot borrowing; services/model/kv_loan.h).
  // A layer-major prefill of [cache_length(), from_token) borrows the rows past its span for
  // extra expert slots: up to max_records pieces of record_bytes (KvCache::Lend). While the loan
  // is out every forward that would write a lent row fails with FAILED_PRECONDITION (decoder and
  // MTP layers alike); the span's own prefill writes below from_token only. FAILED_PRECONDITION
  // too when from_token is below the cache or the MTP cache length (live rows) or another loan
  // is out; INVALID_ARGUMENT as KvCache::Lend.
  absl::StatusOr<KvLoan> LendKvRoom(int64_t from_token, int64_t record_bytes, int64_t max_records);
  // How many pieces LendKvRoom would lend (a worker's start report, for the smallest from_token).
  int64_t LendableKvRecords(int64_t from_token, int64_t record_bytes, int64_t max_records) const {
    return cache_.LendableRecords(from_token, record_bytes, max_records);
  }
  // The cache itself, read-only (what a loan's pieces are checked against).
  const KvCache& kv_cache() const { return cache_; }

  // --- Step graphs (services/model/step_graph.cc). A forward of up to kMaxStepGraphTokens
  // tokens (a decode step, an MTP verification) on a backend that can capture runs as a graph:
  // the first step in a (tokens, context bucket) runs op by op with the position and token ids
  // read from device memory, which sizes every scratch and workspace; the next one captures the
  // same ops once, and every later step in the bucket replays them with one launch. The graph
  // reads positions up to its bucket's end (the kernels take each query's real keys from the
  // device position), so a bucket of 2^k / 4 positions (256 at least) costs one capture.
  // Applies only where every op of the step can be captured: one rank (no collectives), every
  // MoE layer routed on the backend (packed experts, no calibration observer, no per-expert slot
  // source), so NVFP4-served and checkpoint-expert models run op by op.
  static constexpr int64_t kMaxStepGraphTokens = 4;
  struct StepGraphStats {
    int64_t captured = 0;  // graphs captured
    int64_t replayed = 0;  // forwards that ran as a graph replay
    int64_t warmups = 0;   // first steps of a bucket, run op by op with device positions
    // Host time of the graphed forwards that ran a step graph (GraphedForward: a plain step or a
    // verification), split where the GPU can idle: from the call to the launch (checks, the slot
    // tables, the inputs' copies to the device), the launch and the wait for its outputs, and
    // from their return to the call's (the routing log's flush). Nanoseconds, summed.
    int64_t timed_forwards = 0;
    int64_t host_before_launch_ns = 0;
    int64_t launch_and_wait_ns = 0;
    int64_t host_after_wait_ns = 0;
    // Why graphs were turned off for this model, when a capture failed (the step then ran op by
    // op and every later one does too); OK otherwise.
    absl::Status disabled;
  };
  const StepGraphStats& step_graph_stats() const { return step_graph_stats_; }
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

  // A residual connection not yet added to x: the next norm of x adds it in the same op
  // (Backend::AddRmsNorm), so on the GPU the Add costs no launch of its own. One or two deltas
  // (an MoE block's routed and shared outputs, summed first, as adding their sum would).
  struct PendingResidual {
    kernels::Tensor first, second;
    bool empty() const { return !first.valid(); }
  };
  // y = norm(x + pending) with x left holding the sum (y may be x), in one op with
  // ModelOptions::fused_residual_norm; pending is emptied.
  // The MLA rope part (keys or queries) and, with a DSA indexer, the indexer's counterpart rotated
  // at the same positions in one op (one launch on CUDA), each in its model's pair layout.
  absl::Status RopeMlaAndIndexer(kernels::Tensor& mla, kernels::Tensor* indexer, kernels::StepPosition start_pos);
  absl::Status NormWithResidual(kernels::Tensor& x, PendingResidual& pending, const kernels::Tensor& weight,
                                kernels::Tensor& y);
  // x += pending, as Adds (for the paths that read x before its next norm); pending is emptied.
  absl::Status AddResidual(kernels::Tensor& x, PendingResidual& pending);

  // x [T, D] (the residual stream) through decoder block `layer` at `start_pos`; `cache_index`
  // selects the LayerCache (decoder layers first, then MTP layers). With `pending`, the residual
  // it holds is added by this layer's first norm, and the layer's own last one is left in it for
  // the caller's next norm; without, x is complete on return.
  absl::Status RunLayer(const LayerWeights& w, int64_t layer, size_t cache_index, kernels::Tensor& x,
                        kernels::StepPosition start_pos, PendingResidual* pending = nullptr);
  // The two halves of RunLayer. AttentionBlock: x += all-reduce(attention(norm(x))).
  absl::Status AttentionBlock(const LayerWeights& w, int64_t layer, size_t cache_index, kernels::Tensor& x,
                              kernels::StepPosition start_pos);
  // FfnBlock: x += all-reduce(ffn(norm(x))). For an MoE layer, `routing` (when given) is the
  // routing of x's tokens already computed (layer-major prefill), and `slots` overrides the slot
  // source of a packed layer.
  absl::Status FfnBlock(const LayerWeights& w, int64_t layer, kernels::Tensor& x, const MoeRouting* routing,
                        const PrefillLayerSlots* slots);
  // The blocks with their residuals pending: each adds what `pending` holds in its norm and
  // leaves its own output there.
  absl::Status AttentionResidual(const LayerWeights& w, int64_t layer, size_t cache_index, kernels::Tensor& x,
                                 kernels::StepPosition start_pos, PendingResidual& pending);
  absl::Status FfnResidual(const LayerWeights& w, int64_t layer, kernels::Tensor& x, const MoeRouting* routing,
                           const PrefillLayerSlots* slots, PendingResidual& pending);
  // The router of an MoE layer on x's post-attention norm (observers not called).
  absl::StatusOr<MoeRouting> RouteLayer(const LayerWeights& w, const kernels::Tensor& x);
  absl::StatusOr<kernels::Tensor> Attention(const AttentionWeights& w, int64_t layer, size_t cache_index,
                                            const kernels::Tensor& xn, kernels::StepPosition start_pos);
  // `down_input`, when set, receives the activations that enter down_proj (host copy).
  absl::StatusOr<kernels::Tensor> Mlp(const MlpWeights& w, const kernels::Tensor& xn,
                                      std::vector<float>* down_input = nullptr);
  absl::StatusOr<MoeRouting> Route(const MoeWeights& w, const kernels::Tensor& xn);
  // Whether an MoE layer routes on the backend: packed experts, and nothing on the host needs
  // the routing before the layer's experts run (no calibration observer, no per-expert slot
  // source, no routing given by a layer-major prefill).
  bool RoutesOnBackend(const MoeWeights& w) const;
  // Per token of xn [T, D], the squared L2 norm (the predictor's salience input); reads xn on the host.
  absl::StatusOr<std::vector<float>> InputSquaredNorms(const kernels::Tensor& xn);
  // Routing on the backend, then the packed experts; the routing is copied to host staging
  // without waiting and reaches the observers in FlushRoutingLog.
  // The routed experts' output and, apart (invalid without a shared expert), the shared expert's.
  absl::StatusOr<std::pair<kernels::Tensor, kernels::Tensor>> BackendRoutedMoe(const MoeWeights& w, int64_t layer,
                                                                                const kernels::Tensor& xn);
  // The arena of a packed layer's slots for NqMoe (the slot table is set by the caller).
  kernels::NqSlots LayerSlots(const PackedExperts& w, int64_t layer, const PrefillLayerSlots* prefill) const;
  // Uploads every packed layer's slot table when the table source's generation moved (or the
  // static choice, once, without a source).
  absl::Status RefreshSlotTables();
  // Sizes the routing staging for a forward of `tokens` tokens and forgets the last forward's log.
  absl::Status BeginRoutingLog(int64_t tokens);
  // After the forward's last wait for the backend: hands each logged layer's routing to the
  // table source's count and the routing observer, in layer order.
  void FlushRoutingLog();
  absl::StatusOr<kernels::Tensor> Moe(const MoeWeights& w, int64_t layer, const kernels::Tensor& xn,
                                      const MoeRouting& routing, const PrefillLayerSlots* slots);
  // The routed experts of a release-served layer through Backend::NqMoe.
  absl::StatusOr<kernels::Tensor> PackedMoe(const PackedExperts& w, int64_t layer, const kernels::Tensor& xn,
                                            const MoeRouting& routing, const PrefillLayerSlots* slots);
  // The routed experts of an NVFP4-served layer through Backend::Nvfp4Moe (every expert
  // resident: no slots, no observer calls).
  absl::StatusOr<kernels::Tensor> Nvfp4Moe(const Nvfp4Experts& w, const kernels::Tensor& xn, const MoeRouting& routing);
  // `head` over the normed states [T, D] on the backend: F32 [T, V] on one rank; a
  // tensor-parallel rank's vocabulary block gathered from every rank, [W, T, Vr] (rank r's block
  // r, so one row is the logits row itself).
  absl::StatusOr<kernels::Tensor> HeadLogits(const kernels::Tensor& hidden_normed, const kernels::Tensor& head);
  // A tensor-parallel rank's gathered blocks [W, T, Vr] as logits rows [T, W * Vr] on the backend
  // (the step graph's steps of more than one token): W * T row copies, which a graph records.
  absl::StatusOr<kernels::Tensor> InterleaveRankBlocks(kernels::Tensor gathered);
  // HeadLogits as logits rows on the backend, [T, W * Vr] (the step graphs' heads): one row is
  // the gathered blocks as they lie, more are interleaved.
  absl::StatusOr<kernels::Tensor> LogitRows(const kernels::Tensor& hidden_normed, const kernels::Tensor& head);
  // HeadLogits on the host, the ranks' blocks interleaved into full logits [T, V].
  absl::StatusOr<std::vector<float>> Logits(const kernels::Tensor& hidden_normed, const kernels::Tensor& head);
  // The decoder stack over `tokens`; leaves the final-normed hidden states in `x`.
  absl::Status RunStack(std::span<const int32_t> tokens, kernels::Tensor& x);
  // MTP layer `index` over its entries; leaves the shared_head-normed states in `u`.
  absl::Status RunMtp(std::span<const int32_t> next_tokens, std::span<const float> hidden, int index,
                      kernels::Tensor& u);
  absl::Status AllReduce(kernels::Tensor& t);
  // The MTP layer's input from the embedded next tokens `e` and the main model's states `h`
  // (both [T, D], normalised in place): eh_proj(concat(enorm(e), hnorm(h))).
  absl::StatusOr<kernels::Tensor> MtpInput(const MtpWeights& m, kernels::Tensor& e, kernels::Tensor& h);
  // Step graphs (step_graph.cc): whether a forward of `tokens` (of MTP layer `mtp_index`, or of
  // the decoder stack for -1) can run as one, and the forwards that do (logits of every token,
  // row-major [T, vocab_size]; last_hidden() / last_mtp_hidden() as their eager forms).
  bool StepGraphApplies(size_t tokens, int mtp_index = -1) const;
  // With `sample` (one entry for every row, or one per token), the graph also samples every
  // token's row (Backend::SampleTokens) and hands back their ids in `sampled` ([tokens]) instead
  // of the logits (the result is then empty); with `logit_delta` ([V], one token) too, the row
  // plus it is what the draw reads.
  absl::StatusOr<std::vector<float>> GraphedForward(std::span<const int32_t> tokens,
                                                    std::span<const kernels::SampleParams> sample = {},
                                                    std::span<int32_t> sampled = {},
                                                    std::span<const float> logit_delta = {});
  // row[i] += delta[i] on the host, as the graph's Add does (nothing for an empty delta).
  static void AddLogitDelta(std::span<const float> delta, std::span<float> row);
  absl::StatusOr<std::vector<float>> GraphedMtpForward(std::span<const int32_t> next_tokens,
                                                       std::span<const float> hidden, int index);
  // Enqueues a step's ops (embedding of `ids` to the logits and final states copied into
  // step_output_) with the position read from step_position_, at most `start_bound`: the decoder
  // stack, or MTP layer `index` over `hidden` (F32 [T, D] on the backend). With `sample`
  // (sample_params U8 [T, sizeof(SampleParams)] and sampled I32 [T] on the backend), the stack's
  // step samples every row into `sampled` and copies those ids in place of the logits; with
  // logit_delta (F32 [1, V], one token) it adds that row to the logits first.
  struct StepSampling {
    const kernels::Tensor* sample_params = nullptr;
    kernels::Tensor* sampled = nullptr;
    const kernels::Tensor* logit_delta = nullptr;
  };
  absl::Status EnqueueStep(const kernels::Tensor& ids, int64_t start_bound, const StepSampling* sample = nullptr);
  // The logits' row length a graphed forward hands back: the whole vocabulary on every rank.
  int64_t StepGraphVocab() const;
  absl::Status EnqueueMtpStep(int index, const kernels::Tensor& ids, const kernels::Tensor& hidden,
                              int64_t start_bound);
  // MTP layer `index` over `ids` and `hidden` (F32 [T, D], left as it is) at `position`: the
  // shared_head-normed states [T, D].
  absl::StatusOr<kernels::Tensor> EnqueueMtpForward(int index, const kernels::Tensor& ids,
                                                    const kernels::Tensor& hidden, kernels::StepPosition position);
  // InvalidArgument for an id outside [0, vocab): a graph's embedding cannot refuse one.
  static absl::Status CheckTokenIds(std::span<const int32_t> tokens, int64_t vocab, absl::string_view what);
  struct StepGraph;
  // DraftOnDevice's ops (mtp_drafts.cc) over the inputs in `graph` (ids, hidden,
  // forward_positions, sample_params), leaving the last state and the drafts in step_output_.
  absl::Status EnqueueMtpDrafts(int index, StepGraph& graph, int64_t bucket_end);
  // Runs the step of `graph` (its inputs uploaded): the bucket's first step op by op as
  // `enqueue` gives it, the second captured then replayed, later ones replayed. False when the
  // capture failed: graphs are then off for this model and nothing of the step ran.
  absl::StatusOr<bool> RunStepGraph(StepGraph& graph, const std::function<absl::Status()>& enqueue);
  // Sizes the step graphs' shared inputs and outputs (once).
  absl::Status PrepareStepGraphs();
  // What every graphed forward does first: refuses ids outside the vocabulary (CheckTokenIds),
  // brings the slot tables up to date, opens the routing log for `log_rows` rows and sizes the
  // graphs' shared buffers.
  absl::Status BeginGraphedForward(std::span<const int32_t> tokens, int64_t log_rows, absl::string_view what);
  // The last position + 1 a step ending at `end` is captured for (its bucket's end).
  int64_t StepGraphBucketEnd(int64_t end) const;
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
  bool observe_mtp_routing_ = true;
  // Whether the routing observer wants `layer`'s routing.
  bool ObservesRouting(int64_t layer) const {
    return routing_observer_ && (observe_mtp_routing_ || layer < config_.num_hidden_layers);
  }
  int lookahead_depth_ = 0;
  std::function<void(int64_t, const MoeRouting&)> lookahead_observer_;
  std::function<void(int64_t)> lookahead_layer_ran_;
  ExpertSlotSource slot_source_;
  std::optional<SlotArena> arena_;
  // The slot table each packed layer's NqMoe reads (model layer id): written before each use on
  // the host-routed path, by RefreshSlotTables on the backend-routed one.
  std::map<int64_t, kernels::Tensor> slot_tables_;
  std::optional<ExpertSlotTables> slot_table_source_;
  // SetSlotMailbox's: the row of every layer, the private (seq, slot) per entry it was applied
  // to (I32 [L * E, 2]; ApplySlotMailbox), the table it writes (I32 [L, E]) and each layer's row
  // in it. apply_due: no MoE block of the running forward applied it yet.
  struct Mailbox {
    kernels::SlotMailboxRow row;
    kernels::Tensor applied;
    kernels::Tensor table;
    std::map<int64_t, int64_t> row_of_layer;
    bool apply_due = true;
  };
  std::optional<Mailbox> mailbox_;
  // A forward begins: its first packed MoE block applies the mailbox.
  void MailboxForwardBegins() {
    if (mailbox_.has_value()) mailbox_->apply_due = true;
  }
  // Issues the mailbox's apply if this forward has not yet (no-op without a mailbox).
  absl::Status ApplyMailboxIfDue();
  // The slot table a packed MoE block of `layer` reads (prefill: its own slots take precedence):
  // the mailbox's row, applied first if this forward has not yet, else the layer's own table.
  absl::StatusOr<std::pair<const kernels::Tensor*, int64_t>> SlotTableFor(int64_t layer);
  // The generation of the tables on the backend (nullopt: not uploaded since the last change of
  // source, or written by the host-routed path).
  std::optional<uint64_t> uploaded_generation_;
  // Backend-routed layers of the running forward: where each one's ids and weights land in
  // routing_staging_ (host memory the backend copies into without waiting).
  struct LoggedRouting {
    int64_t layer = 0;
    int tokens = 0;
    int top_k = 0;
    size_t offset = 0;  // bytes: ids (I32) then weights (F32), tokens * top_k each
    std::vector<float> input_sq_norms;  // MoeRouting::input_sq_norms, when known on the host
    // Bytes into the staging of the tokens' xn xnᵀ (F32 [tokens, tokens]; its diagonal is
    // input_sq_norms), or -1.
    int64_t gram_offset = -1;
  };
  std::vector<LoggedRouting> routing_log_;
  std::unique_ptr<kernels::Storage> routing_staging_;
  size_t routing_staging_used_ = 0;
  uint64_t routing_staging_generation_ = 0;  // bumped when routing_staging_ is replaced
  // Step graphs, by (-1 for the decoder stack or the MTP layer's index, tokens, bucket end,
  // whether the step samples on the backend, the drafts of a drafting chain or 0).
  struct StepGraph {
    std::unique_ptr<kernels::Backend::Graph> graph;  // null until captured (after the warm-up)
    kernels::Tensor ids;                             // I32 [tokens], the step's input
    kernels::Tensor hidden;                          // F32 [tokens, D]: an MTP step's input states
    kernels::Tensor sample_params;                   // U8 [tokens, sizeof(SampleParams)]: a sampling step's draw
    kernels::Tensor sampled;                         // I32 [tokens]: a sampling step's ids
    kernels::Tensor logit_delta;                     // F32 [1, vocab]: an adjusted draw's (one token)
    // A drafting chain's (DraftOnDevice): each forward's first position, I32 [1] (a StepPosition
    // is a whole tensor); draft i, I32 [1], is the next forward's input (draft_ids).
    std::vector<kernels::Tensor> forward_positions;
    std::vector<kernels::Tensor> draft_ids;
    bool warmed = false;                             // a warm-up ran under these generations
    uint64_t backend_generation = 0;
    uint64_t staging_generation = 0;
    std::vector<LoggedRouting> routing_log;  // where a replay leaves each layer's routing
  };
  // Keyed by (MTP index or -1, tokens, bucket end, samples, variant): a drafting chain's draft
  // count (mtp_drafts.cc), or 1 for a forward whose draw adds a logit delta row.
  std::map<std::tuple<int64_t, int64_t, int64_t, bool, int>, StepGraph> step_graphs_;
  kernels::Tensor step_position_;                // I32 [1]: the step's first position
  // Host staging: logits [T, V] (a sampling step: ids I32 [T]), then hidden [T, D].
  std::unique_ptr<kernels::Storage> step_output_;
  StepGraphStats step_graph_stats_;
};

}  // namespace nq::model
