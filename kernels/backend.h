// The compute backend the model code calls (DESIGN.md "Backends"): memory, copies and ops, with
// a CPU implementation (fp32 reference, kernels/cpu/) and a CUDA one (kernels/cuda/).
//
// Public ops validate their arguments here, once for every backend (dtype, shape, ownership), and
// then call the backend's Do* hook with the dimensions already worked out; an implementation only
// computes. Errors are InvalidArgumentError naming the op, the argument and the shapes, so a bad
// call never reaches a kernel.
//
// Execution model: ops are enqueued in order on the backend's one stream and may run
// asynchronously (CUDA); Synchronize() waits for them and reports any asynchronous failure.
// CopyToHost returns only once the data is on the host. A Backend is not thread-safe: one
// thread drives it (the worker's decode loop).
//
// Later issues add ops here in the same shape (public validating method + Do* hook): MLA
// attention, RoPE, routing, NestQuant dequant-GEMV. The tensor-parallel communicator is a
// separate interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/decode_gemv.h"
#include "kernels/dtype.h"
#include "kernels/kv_fp8.h"
#include "kernels/moe_route.h"
#include "kernels/nq_moe.h"
#include "kernels/nq_moe_params.h"
#include "kernels/nvfp4_moe.h"
#include "kernels/nvfp4_moe_params.h"
#include "kernels/sample_tokens.h"
#include "kernels/slot_mailbox.h"
#include "kernels/step_position.h"
#include "kernels/tensor.h"

namespace nq::kernels {

// Geometry of y[m, n] = x[m, k] · w[n, k]^T after validation (leading dims of x folded into m).
struct MatMulDims {
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
};

// Geometry of a row-wise op over the last dim: `rows` rows of `cols` contiguous elements.
struct RowDims {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // "cpu" or "cuda".
  virtual std::string_view name() const = 0;
  // Human-readable device, e.g. "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" or "cpu (16 threads)".
  virtual std::string DeviceDescription() const = 0;
  // Whether NqMoe applies the low-rank corrections of kernels/nq_moe.h (issue #16). A backend that
  // does not refuses a layer that has them (FailedPrecondition) rather than serving it without:
  // the CPU and CUDA backends apply them.
  virtual bool AppliesNqLowRank() const { return false; }
  // Unique per backend instance in this process; tensors carry it (Tensor::backend_id()).
  std::uint64_t id() const { return id_; }

  // ---- Memory ----

  // A new uninitialised row-major tensor. InvalidArgumentError for a negative dimension or a
  // size that overflows; ResourceExhaustedError when the device is out of memory.
  absl::StatusOr<Tensor> Allocate(DType dtype, Shape shape);

  // Copies exactly dst.nbytes() bytes from host memory; `src` may be reused once this returns,
  // except when it lies in memory from AllocateHostStaging: from there the CUDA copy runs
  // without the host waiting, and `src` must stay unchanged until a later Synchronize (or copy
  // to the host) returns.
  absl::Status CopyFromHost(std::span<const std::byte> src, Tensor& dst);
  // Copies src into bytes [dst_offset, dst_offset + src.size()) of `dst`, leaving the rest of it
  // as it is: a record placed inside a larger tensor (a layer-major prefill's expert slots in
  // room the free KV cache lends, issue #23). The same rule for `src` as CopyFromHost (from
  // AllocateHostStaging memory the copy runs without the host waiting). INVALID_ARGUMENT for a
  // range that does not lie inside dst.
  absl::Status CopyFromHostAt(std::span<const std::byte> src, Tensor& dst, std::size_t dst_offset);
  // Copies exactly src.nbytes() bytes to host memory, after all work enqueued before it.
  absl::Status CopyToHost(const Tensor& src, std::span<std::byte> dst);
  // Host memory a device-to-host copy can land in without the host waiting for the device
  // (page-locked on CUDA, plain memory on the CPU). For CopyToHostAsync.
  absl::StatusOr<std::unique_ptr<Storage>> AllocateHostStaging(std::size_t bytes);
  // Enqueues a copy of src's src.nbytes() bytes into `dst`, which must lie in memory from
  // AllocateHostStaging, and returns without waiting: the bytes are there once a later
  // CopyToHost or Synchronize returns (issued as side work: once it is joined and then one of
  // those returns). (From other host memory the CUDA runtime would wait for the stream, which is
  // what this exists to avoid.)
  absl::Status CopyToHostAsync(const Tensor& src, std::span<std::byte> dst);
  // Device-to-device copy between two tensors of this backend with equal dtype and shape.
  absl::Status Copy(const Tensor& src, Tensor& dst);
  // dst[dst_row + i] = src[src_row + i] for i < rows, a row being everything past the first
  // dimension: both of one dtype and one row shape. The row offsets are fixed when the op is
  // issued, so it captures into a graph (a row of a step's output feeding the next step).
  absl::Status CopyRows(const Tensor& src, std::int64_t src_row, Tensor& dst, std::int64_t dst_row,
                        std::int64_t rows);

  // Waits for every enqueued op; returns the first asynchronous error, if any.
  virtual absl::Status Synchronize() = 0;

  // ---- Ops (F32 activations, F32 accumulation and output) ----

  // Linear layer: y[..., n] = x[..., k] · w[n, k]^T, weights stored [out, in] as in HF
  // checkpoints. x: F32 [..., k]; w: F32, BF16 or F16 [n, k]; y: F32 [..., n]. y must not be x.
  absl::Status MatMul(const Tensor& x, const Tensor& w, Tensor& y);

  // MatMul by an FP8 weight as FP8 checkpoints store it: w = w_fp8 * scale_inv per 128 x 128
  // block, i.e. w[j, p] = float(w_fp8[j, p]) * scale_inv[j / 128, p / 128], never materialised.
  // x: F32 [..., k]; w_fp8: F8_E4M3 [n, k]; scale_inv: F32 [ceil(n / 128), ceil(k / 128)];
  // y: F32 [..., n]. y must not be x. A NaN weight (0x7f / 0xff) makes its outputs NaN.
  absl::Status MatMulBlockScaled(const Tensor& x, const Tensor& w_fp8, const Tensor& scale_inv,
                                 Tensor& y);

  // Linear layers that read one input: ys[i][..., n_i] = x[..., k] · ws[i][n_i, k]^T, exactly as
  // MatMul (or MatMulBlockScaled, for an FP8 weight with its scales) of each pair, but in one pass
  // where the backend can. A decode step's projections of one normalised hidden state (MLA's q_a,
  // kv_a and k_pe, the DSA indexer's key and head-weight projections) are each too small to keep
  // a GPU's memory busy alone; the CUDA GEMV runs all their rows in one launch. ws: F32, BF16 or
  // F16 [n_i, k] without scales, or F8_E4M3 with scale_inv as MatMulBlockScaled takes it; at most
  // kMaxSharedInputMatMuls of them; ys pairwise distinct, none the same tensor as x or a w.
  struct WeightRef {
    const Tensor* w = nullptr;
    const Tensor* scale_inv = nullptr;  // F8_E4M3 weights only
  };
  static constexpr int kMaxSharedInputMatMuls = 8;
  absl::Status MatMulSharedInput(const Tensor& x, std::span<const WeightRef> ws, std::span<Tensor* const> ys);

  // y = x / sqrt(mean(x^2 over the last dim) + eps) * weight. x, y: F32 [..., d] (y may be x);
  // weight: F32, BF16 or F16 [d]; eps >= 0 and finite.
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y);

  // A residual connection and the norm after it in one op (one launch on the GPU, where the Add
  // and the RmsNorm of a decode step are each a latency-bound kernel): x += d0 (+ d1), summed as
  // Add would, x + (d0 + d1) with two, then y = RmsNorm(x). x, deltas, y: F32 of one shape
  // [..., d]; one or two deltas, neither x nor y. y may be x (x then ends normalised); else x
  // keeps the sum. weight and eps as RmsNorm's. Results are bit-identical to the Adds and the
  // RmsNorm run one after another.
  absl::Status AddRmsNorm(Tensor& x, std::span<const Tensor* const> deltas, const Tensor& weight, float eps,
                          Tensor& y);

  // y[..., j] = silu(x[..., j]) * x[..., d + j] for j < d (gate first, then up, as vLLM's
  // silu_and_mul). x: F32 [..., 2d]; y: F32 [..., d]; y must not be x.
  absl::Status SiluAndMul(const Tensor& x, Tensor& y);

  // y = softmax(scale * x) over the last dim, computed stably (max subtracted). A row that is
  // entirely -inf (fully masked) gives zeros. x, y: F32 [..., n] (y may be x); scale finite.
  absl::Status Softmax(const Tensor& x, float scale, Tensor& y);

  // ---- Model ops (the MLA / DSA / MoE graph of services/model) ----

  // out[t, :] = table[ids[t], :]. ids: host token ids, each < V; table: F32/BF16/F16 [V, d];
  // out: F32 [T, d] with T = ids.size().
  absl::Status Embedding(std::span<const std::int32_t> ids, const Tensor& table, Tensor& out);
  // The same with the ids on this backend (I32 [T]), read when the op runs (a captured step
  // graph's input tokens). The CPU backend refuses an id >= V when it runs; the CUDA kernel,
  // which cannot report it, writes a zero row for it.
  absl::Status Embedding(const Tensor& ids, const Tensor& table, Tensor& out);

  // out = a + b elementwise. All F32 of one shape; out may be a or b.
  absl::Status Add(const Tensor& a, const Tensor& b, Tensor& out);

  // Rotary embedding in place on the first r = 2 * inv_freq.size() elements of the last dim
  // of x: F32 [T, n, d] with d >= r (the rest of each head is left as is: the DSA indexer
  // rotates only the leading rope slice of its heads). Token t sits at position
  // start_pos + t (kernels/step_position.h: a host value or one read from the device); frequency i = inv_freq[i] (host); the angle is computed in float32 as HF
  // does; cos and sin are multiplied by `attention_scaling` (yarn). interleaved: pairs
  // (x[2i], x[2i+1]) rotate by frequency i (DeepSeek / GPT-J layout); otherwise pairs
  // (x[i], x[i + r/2]) (NeoX / rotate_half layout).
  absl::Status Rope(Tensor& x, StepPosition start_pos, std::span<const float> inv_freq,
                    float attention_scaling, bool interleaved);

  // Rope of several tensors at the same positions and frequencies, each with its own pair layout
  // (the query's MLA rope part and the DSA indexer's queries, whose layouts may differ): one
  // launch on CUDA instead of one a tensor. Every x as Rope says, all with the same token count,
  // 1 to kMaxRopeTargets of them, no two sharing memory.
  struct RopeTarget {
    Tensor* x = nullptr;
    bool interleaved = false;
  };
  static constexpr int kMaxRopeTargets = 4;
  absl::Status Rope(std::span<const RopeTarget> targets, StepPosition start_pos, std::span<const float> inv_freq,
                    float attention_scaling);

  // y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance).
  // x, y: F32 [..., d] (y may be x); weight, bias: F32 [d].
  absl::Status LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                         Tensor& y);

  // dst[row_offset + i, :] = src[i, :]. src: F32 [n, d]; dst: F32 or BF16 [*, d] (a BF16 dst
  // stores each value rounded to nearest even, kernels/dtype.h ToBf16: the BF16 latent KV
  // cache), or U8 [*, KvFp8RowBytes(d)]: FP8 latent rows, each src row packed as
  // kernels/kv_fp8.h says (the CPU backend only, so far); the rows must fit in dst (checked
  // against the bound of a device row_offset).
  absl::Status WriteRows(const Tensor& src, Tensor& dst, StepPosition row_offset);

  // out[i, :] = x[rows[i], :]. x: F32 [T, d]; rows: host, each < T; out: F32 [rows.size(), d].
  absl::Status GatherRows(const Tensor& x, std::span<const std::int32_t> rows, Tensor& out);

  // out[rows[i], :] += weights[i] * src[i, :]. src: F32 [n, d]; rows, weights: host, n each;
  // out: F32 [T, d]. Rows may repeat (accumulated in index order).
  absl::Status ScatterAddRows(const Tensor& src, std::span<const std::int32_t> rows,
                              std::span<const float> weights, Tensor& out);

  // Multi-head latent attention over a latent KV cache, in the absorbed form (DeepSeek-V3):
  //   q_lat[t,h,:]  = q_nope[t,h,:] · w_uk[h]                      ([dn] x [dn, c] -> [c])
  //   score[t,h,s]  = scale * (q_lat[t,h,:] · kv_latent[s,:] + q_pe[t,h,:] · k_pe[s,:])
  //   p             = softmax over the keys s query t may see
  //   out[t, h*dv:(h+1)*dv] = w_uv[h] · (sum_s p[t,h,s] kv_latent[s,:])
  // Query t sits at position start_pos + t and sees keys s <= start_pos + t; when `selected`
  // is given (DSA), only the keys it lists for t (I32 [T, K], -1 = none; duplicates are not
  // allowed). Shapes: q_nope F32 [T, H, dn]; q_pe F32 [T, H, dr]; kv_latent F32 or BF16 [S, c]
  // with k_pe [S, dr] of kv_latent's dtype, or FP8 rows U8 [S, KvFp8RowBytes(c)]
  // (kernels/kv_fp8.h; the CPU backend only, so far) with k_pe BF16, and S >= start_pos + T; w_uk F32/BF16 [H, dn, c]; w_uv F32/BF16
  // [H, dv, c]; out F32 [T, H * dv]. A device start_pos is checked against the cache by its bound.
  absl::Status MlaAttention(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_latent,
                            const Tensor& k_pe, const Tensor& w_uk, const Tensor& w_uv,
                            const Tensor* selected, StepPosition start_pos, float scale,
                            Tensor& out);

  // DSA indexer selection: for query t (position start_pos + t) and each visible key
  // s <= start_pos + t,  score[t,s] = sum_h weights[t,h] * relu(q[t,h,:] · k[s,:]); selects
  // the top_k keys by score (ties to the lower s) and writes them to selected[t, :] in
  // ascending key order (the order attention reads them in), padding with -1 when fewer than
  // top_k keys are visible. q F32 [T, Hi, d]; k F32 [S, d] with
  // S >= start_pos + T (its bound, for a device start_pos); weights F32 [T, Hi]; selected
  // I32 [T, top_k].
  absl::Status IndexerTopK(const Tensor& q, const Tensor& k, const Tensor& weights,
                           StepPosition start_pos, Tensor& selected);

  // The MoE router (kernels/moe_route.h) where the logits are: ids[t, :] and weights[t, :] are
  // token t's top_k experts, by descending choice score, and their weights, as RouteTokensHost
  // computes them. logits: F32 [T, E] with E = params.num_experts <= kMaxRoutedExperts; bias:
  // F32 [E] or null; ids: I32 [T, top_k]; weights: F32 [T, top_k].
  absl::Status MoeRoute(const Tensor& logits, const Tensor* bias, const MoeRouteParams& params, Tensor& ids,
                        Tensor& weights);

  // Next-token sampling where the logits are (kernels/sample_tokens.h): ids[r] is the id
  // SampleRowHost picks from logits[r, :] with the SampleParams at params[r], or kNoFiniteLogit
  // for a row without a finite logit. logits: F32 [R, V] with V < 2^24; params: U8
  // [R, sizeof(SampleParams)] on this backend (a captured step reads the draw the host wrote
  // before the replay); ids: I32 [R]. The CPU backend refuses parameters outside their ranges
  // (SampleParamsError) when it runs; the CUDA kernel, which cannot report, clamps them.
  absl::Status SampleTokens(const Tensor& logits, const Tensor& params, Tensor& ids);

  // The routed experts of one MoE layer from their NestQuant codes (kernels/nq_moe.h):
  // out[t] = sum_k expert_weights[t, k] * expert(expert_ids[t, k])(x[t]), each expert at 4 bits
  // when slots.slot_of_expert names a slot for it, else at 2 bits. x, out: F32 [T, D] (distinct);
  // expert_ids: I32 [T, K]; expert_weights: F32 [T, K], on this backend. Ids must be < E and
  // distinct within a token: the CPU backend checks them (InvalidArgument), the CUDA kernels,
  // which never read back to the host, skip an out-of-range id.
  absl::Status NqMoe(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                     const NqMoeWeights& weights, const NqSlots& slots, Tensor& out);

  // The routed experts of one MoE layer from their NVFP4 codes (kernels/nvfp4_moe.h):
  // out[t] = sum_k expert_weights[t, k] * expert(expert_ids[t, k])(x[t]). x, out: F32 [T, D]
  // (distinct); expert_ids: I32 [T, K]; expert_weights: F32 [T, K], on this backend. Ids must be
  // < E: the CPU backend checks them (InvalidArgument), the CUDA kernels, which never read back
  // to the host, skip an out-of-range id.
  absl::Status Nvfp4Moe(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                        const Nvfp4MoeWeights& weights, Tensor& out);

  // One MoE layer's row of the slot mailbox (kernels/slot_mailbox.h): for each expert e whose
  // row.seq[e] differs from the sequence number in applied[e], takes row.staged[e] into applied[e]
  // and publishes both to row.published[e]; then sets slot_of_expert[e] to applied[e]'s slot for
  // every e. applied: I32 [E, 2] on this backend, the worker's private (slot, seq) per expert
  // (packed as published is: MailboxEntrySeq / MailboxEntrySlot of its 8 bytes), initialised to
  // kMailboxEmptyEntry; slot_of_expert: I32 of E elements in any shape (a row may span every
  // layer of a mailbox: E = layers x experts, the table [layers, experts]). The row's memory must be readable and writable
  // by this backend (CUDA: host memory mapped into the device, the row holding its device
  // aliases). Capturable: a captured step applies what was posted before each replay.
  absl::Status ApplySlotMailbox(const SlotMailboxRow& row, Tensor& applied, Tensor& slot_of_expert);

  // ---- Side work: independent ops on a second stream ----

  // A decode step has ops that do not depend on their neighbours (an MoE layer's shared expert
  // beside its router and routed experts; the new keys' norms, rotations and cache writes beside
  // the query projection), and each alone leaves most of a GPU idle. Ops issued between
  // BeginSideWork and EndSideWork run on a side stream: they start after every op issued before
  // BeginSideWork and run beside the ops issued after EndSideWork, until JoinSideWork makes every
  // later op wait for them. Tensors they read or write must not be touched by the main stream in
  // between. After EndSideWork, BeginSideWork again (before the join) adds to the same side
  // work: those ops follow both the side's earlier ops and every main-stream op issued so far.
  // The CPU backend runs every op in call order, so results are equal either way.
  //
  // Every backend refuses on the side (FailedPrecondition) what shares state with the main
  // stream on the CUDA backend: ops using its one scratch block or MoE workspace (Embedding from
  // host ids, GatherRows, ScatterAddRows, MlaAttention, IndexerTopK, NqMoe, Nvfp4Moe) and copies
  // from the host; and while side work is open, Synchronize, CopyToHost and BeginCapture. MatMul*,
  // RmsNorm, SiluAndMul, Softmax, Add, Rope, LayerNorm, WriteRows, Copy, MoeRoute,
  // CopyToHostAsync and Allocate run there. Tensor memory freed from BeginSideWork to
  // JoinSideWork is reused only after the join. EndCapture with side work open joins it and
  // fails. FailedPrecondition for calls out of order (Begin while on the side, End when not on
  // the side, Join with nothing open).
  absl::Status BeginSideWork();
  // After EndSideWork, before the join: ops go to the side stream again, after the side's earlier
  // ops only (not after the main-stream ops issued since). So a main-stream op issued between
  // the two runs beside the side's, yet is issued (and in a captured graph, created) first.
  // FailedPrecondition unless side work is open and ended.
  absl::Status ContinueSideWork();
  absl::Status EndSideWork();
  absl::Status JoinSideWork();
  // Whether ops now go to the side stream (between BeginSideWork and EndSideWork).
  bool OnSide() const { return side_work_ == SideWork::kOnSide; }
  // Whether side work is open (not yet joined).
  bool SideWorkOpen() const { return side_work_ != SideWork::kNone; }

  // ---- Captured graphs: a decode step replayed without a host call per op ----

  // A recorded sequence of this backend's ops.
  class Graph {
   public:
    virtual ~Graph() = default;
    // Runs every recorded op once, in order, and waits for them; the first failure, if any.
    virtual absl::Status Run() = 0;
  };
  // Whether BeginCapture works on this backend (CUDA graphs; the CPU runs ops as they are called).
  virtual bool CanCapture() const { return false; }
  // From BeginCapture to EndCapture the ops are recorded, not run: their results exist only once
  // the graph EndCapture returns has run. Their host arguments are fixed at capture, so an op whose
  // input comes from the host at run time must read it from a tensor (StepPosition::OnDevice, the
  // device-ids Embedding); ops that copy host spans or wait for the device (CopyFromHost,
  // CopyToHost, GatherRows, Synchronize, ...) fail while capturing. Every tensor allocated during
  // the capture must be destroyed before EndCapture. EndCapture ends the capture even after a
  // failed op (then it returns that failure).
  virtual absl::Status BeginCapture();
  virtual absl::StatusOr<std::unique_ptr<Graph>> EndCapture();
  // Changes whenever memory the ops use internally (scratch, workspaces, uploaded constants) is
  // replaced: a graph captured under another generation would read freed memory and must not run.
  virtual std::uint64_t CaptureGeneration() const { return 0; }

 protected:
  Backend();

  // Wraps memory this backend allocated into a tensor stamped with this backend's id.
  Tensor MakeTensor(std::unique_ptr<Storage> storage, DType dtype, Shape shape) const;

  // Hooks; arguments are validated (dtypes, shapes, ownership, non-overlap where required).
  virtual absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) = 0;
  virtual absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) = 0;
  virtual absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) = 0;
  virtual absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) = 0;
  // Defaults: heap memory, and a copy that waits (correct everywhere; CUDA overrides both).
  virtual absl::StatusOr<std::unique_ptr<Storage>> AllocateHostStagingStorage(std::size_t bytes);
  virtual absl::Status DoCopyToHostAsync(const void* src, std::size_t bytes, void* dst);
  virtual absl::Status DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                                const MatMulDims& dims) = 0;
  virtual absl::Status DoMatMulBlockScaled(const Tensor& x, const Tensor& w_fp8,
                                           const Tensor& scale_inv, Tensor& y,
                                           const MatMulDims& dims) = 0;
  // dims[i] is the geometry of ws[i] (every m and k equal, every n > 0). Default: DoMatMul (or
  // DoMatMulBlockScaled) of each.
  virtual absl::Status DoMatMulSharedInput(const Tensor& x, std::span<const WeightRef> ws, std::span<Tensor* const> ys,
                                           std::span<const MatMulDims> dims);
  virtual absl::Status DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                                 const RowDims& dims) = 0;
  // dims.cols is d, the width of y (x has 2d columns).
  virtual absl::Status DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) = 0;
  virtual absl::Status DoSoftmax(const Tensor& x, float scale, Tensor& y,
                                 const RowDims& dims) = 0;

  // Model-op hooks. A backend that does not implement one yet returns UnimplementedError
  // (the defaults), so the graph fails with a clear message rather than a wrong answer.
  virtual absl::Status DoEmbedding(std::span<const std::int32_t> ids, const Tensor& table,
                                   Tensor& out);
  virtual absl::Status DoEmbeddingDevice(const Tensor& ids, const Tensor& table, Tensor& out);
  virtual absl::Status DoAdd(const Tensor& a, const Tensor& b, Tensor& out);
  // Default: the Adds (the two deltas into a temporary first) and the RmsNorm as separate ops.
  virtual absl::Status DoAddRmsNorm(Tensor& x, std::span<const Tensor* const> deltas, const Tensor& weight,
                                    float eps, Tensor& y, const RowDims& dims);
  virtual absl::Status DoRope(Tensor& x, const StepPosition& start_pos, std::span<const float> inv_freq,
                              float attention_scaling, bool interleaved);
  // Default: DoRope for each target.
  virtual absl::Status DoRopes(std::span<const RopeTarget> targets, const StepPosition& start_pos,
                               std::span<const float> inv_freq, float attention_scaling);
  virtual absl::Status DoLayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                   float eps, Tensor& y, const RowDims& dims);
  virtual absl::Status DoWriteRows(const Tensor& src, Tensor& dst, const StepPosition& row_offset);
  virtual absl::Status DoGatherRows(const Tensor& x, std::span<const std::int32_t> rows,
                                    Tensor& out);
  virtual absl::Status DoScatterAddRows(const Tensor& src, std::span<const std::int32_t> rows,
                                        std::span<const float> weights, Tensor& out);
  virtual absl::Status DoMlaAttention(const Tensor& q_nope, const Tensor& q_pe,
                                      const Tensor& kv_latent, const Tensor& k_pe,
                                      const Tensor& w_uk, const Tensor& w_uv,
                                      const Tensor* selected, const StepPosition& start_pos, float scale,
                                      Tensor& out);
  virtual absl::Status DoIndexerTopK(const Tensor& q, const Tensor& k, const Tensor& weights,
                                     const StepPosition& start_pos, Tensor& selected);
  virtual absl::Status DoMoeRoute(const Tensor& logits, const Tensor* bias, const MoeRouteParams& params,
                                  Tensor& ids, Tensor& weights);
  // Arguments validated into raw pointers (kernels/nq_moe_op.cc).
  virtual absl::Status DoSampleTokens(const Tensor& logits, const Tensor& params, Tensor& ids);
  virtual absl::Status DoNqMoe(const NqMoeParams& params);
  // Arguments validated into raw pointers (kernels/nvfp4_moe_op.cc).
  virtual absl::Status DoNvfp4Moe(const Nvfp4MoeParams& params);
  virtual absl::Status DoApplySlotMailbox(const SlotMailboxRow& row, Tensor& applied, Tensor& slot_of_expert);
  // The side-work contract (BeginSideWork), checked by the op wrappers for every backend, so the
  // CPU backend's tests hold model code to what the CUDA backend can run: FailedPrecondition for
  // an op that shares state with the main stream issued on the side, and for a host round trip
  // while side work is open.
  absl::Status RefuseOnSide(absl::string_view what) const;
  absl::Status RefuseWithSideWorkOpen(absl::string_view what) const;

  // Side-work hooks (the CUDA backend's streams); called in a valid order only. Defaults: nothing
  // to do (ops run in call order).
  virtual absl::Status DoBeginSideWork() { return absl::OkStatus(); }
  virtual absl::Status DoContinueSideWork() { return absl::OkStatus(); }
  virtual absl::Status DoEndSideWork() { return absl::OkStatus(); }
  virtual absl::Status DoJoinSideWork() { return absl::OkStatus(); }

 private:
  // InvalidArgumentError unless `t` is a non-empty tensor allocated by this backend.
  absl::Status CheckOwned(absl::string_view op, absl::string_view arg, const Tensor& t) const;
  // A device position must be an I32 [1] tensor of this backend with a bound >= 0.
  absl::Status CheckStepPosition(absl::string_view op, absl::string_view arg, const StepPosition& p) const;

  std::uint64_t id_;
  enum class SideWork { kNone, kOnSide, kForked };
  SideWork side_work_ = SideWork::kNone;
};

// Joins side work still open when it leaves scope (an op between Begin and Join failed and the
// caller returned early), so the next forward does not find it open. The join's own failure is
// dropped: the first error already went up.
class SideWorkGuard {
 public:
  explicit SideWorkGuard(Backend& backend) : backend_(backend) {}
  ~SideWorkGuard() {
    if (backend_.SideWorkOpen()) (void)backend_.JoinSideWork();
  }
  SideWorkGuard(const SideWorkGuard&) = delete;
  SideWorkGuard& operator=(const SideWorkGuard&) = delete;

 private:
  Backend& backend_;
};

struct BackendOptions {
  // CUDA device ordinal.
  int device = 0;
  // CUDA: which decode GEMV runs BF16 matrices (kernels/decode_gemv.h); refused by "cpu" unless kAuto.
  DecodeGemv cuda_decode_gemv = DecodeGemv::kAuto;
  // CPU worker threads for large ops; 0 picks std::thread::hardware_concurrency().
  int cpu_threads = 0;
  // CPU: MlaAttention in double (the reference) instead of fp32 (serving). For tests that compare
  // with a float64 reference to a few fp32 ulps of the output.
  bool cpu_float64_attention = false;
};

// "auto", "tensor" or "fma" (the flag nq bench-decode and bench-prefill take); InvalidArgumentError
// for anything else.
absl::StatusOr<DecodeGemv> ParseDecodeGemv(std::string_view name);

// Whether `name` ("cpu", "cuda") was compiled into this build.
bool IsBackendCompiledIn(std::string_view name);

// Creates a backend by name. "cuda" in a build without CUDA is UnimplementedError; "cuda" with no
// usable device (no device or driver, kernels not built for its architecture) is
// FailedPreconditionError; an unknown name, a device ordinal out of range or a CUDA-only option
// (cuda_decode_gemv) given to "cpu" is InvalidArgumentError.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                       const BackendOptions& options = {});

}  // namespace nq::kernels
