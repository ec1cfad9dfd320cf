// CudaBackend: device memory, copies and op dispatch to the kernel families' launchers, all on
// one non-blocking stream per backend.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/blas_handles.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/indexer_topk.cuh"
#include "kernels/cuda/kv_fp8.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/mapped_host_copy.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/mla_attention.cuh"
#include "kernels/cuda/mla_decode.cuh"
#include "kernels/cuda/moe_route.cuh"
#include "kernels/cuda/slot_mailbox.cuh"
#include "kernels/cuda/sample_tokens.cuh"
#include "kernels/cuda/nq_moe.cuh"
#include "kernels/cuda/nq_moe_prefill.cuh"
#include "kernels/cuda/nq_moe_prefill_dense.cuh"
#include "kernels/cuda/nvfp4_moe.cuh"
#include "kernels/cuda/nvfp4_moe_prefill_dense.cuh"
#include "kernels/cuda/pinned_ranges.h"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/rows.cuh"
#include "kernels/cuda/scratch.h"
#include "kernels/cuda/softmax.cuh"
#include "kernels/cuda/stream_pool.h"
#include "kernels/grow_capacity.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();
// Device scratch for the indexer's score matrix; longer prefills are scored in chunks of queries
// (a 4096-token prefill over 4096 keys: 4 chunks of 1024 queries).
constexpr std::size_t kIndexerScoreBytes = std::size_t{16} << 20;
// The first scratch block: small ops (a decode step's ids, rows, inv_freq) never regrow it.
constexpr std::size_t kMinScratchBytes = std::size_t{1} << 20;

// Loaded by CreateCudaBackend to prove the fatbinary holds code this device can run: with lazy
// module loading a missing sm_90a image would otherwise surface only at the first real launch.
__global__ void ProbeKernel() {}

// Tensor memory from the backend's stream-ordered pool (kernels/cuda/stream_pool.h): freeing it
// waits for nothing; the block is reused only by work enqueued after its last use.
class DeviceStorage final : public Storage {
 public:
  DeviceStorage(void* data, std::size_t bytes, std::shared_ptr<StreamPool> pool)
      : Storage(data, bytes), pool_(std::move(pool)) {}
  ~DeviceStorage() override {
    if (pool_ != nullptr) pool_->Free(data());
  }

 private:
  std::shared_ptr<StreamPool> pool_;
};

// Page-locked host memory as a Storage (Backend::AllocateHostStaging), listed in the backend's
// PinnedRanges while it lives (so small copies into it may be kernels: DoCopyToHostAsync).
class PinnedStorage final : public Storage {
 public:
  PinnedStorage(PinnedHostBuffer buffer, std::size_t bytes, std::shared_ptr<PinnedRanges> ranges)
      : Storage(buffer.get(), bytes), buffer_(std::move(buffer)), ranges_(std::move(ranges)) {
    ranges_->Add(buffer_.get(), buffer_.bytes());
  }
  ~PinnedStorage() override { ranges_->Remove(buffer_.get()); }

 private:
  PinnedHostBuffer buffer_;
  std::shared_ptr<PinnedRanges> ranges_;
};

absl::Status CheckIntRange(absl::string_view op, std::initializer_list<std::int64_t> sizes) {
  for (std::int64_t size : sizes) {
    if (size > kMaxInt) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": dimension ", size, " exceeds the CUDA kernels' limit of ", kMaxInt));
    }
  }
  return absl::OkStatus();
}

// An instantiated CUDA graph of the backend's stream; keeps the stream (and pool) alive.
class CudaGraph final : public Backend::Graph {
 public:
  CudaGraph(cudaGraphExec_t exec, std::shared_ptr<StreamPool> pool, int device)
      : exec_(exec), pool_(std::move(pool)), device_(device) {}
  ~CudaGraph() override { (void)cudaGraphExecDestroy(exec_); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  absl::Status Run() override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, pool_->stream()));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(pool_->stream()));
    return absl::OkStatus();
  }

 private:
  cudaGraphExec_t exec_;
  std::shared_ptr<StreamPool> pool_;
  int device_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& props, std::shared_ptr<StreamPool> pool, DecodeGemv decode_gemv)
      : device_(device),
        gemv_kernel_(decode_gemv),
        description_(absl::StrFormat("%s (sm_%d%d, %d SMs, %.1f GiB)", props.name, props.major,
                                     props.minor, props.multiProcessorCount,
                                     props.totalGlobalMem / double{1 << 30})),
        pool_(std::move(pool)),
        ctx_{.stream = pool_->stream(), .num_sms = props.multiProcessorCount},
        kernel_host_copies_(props.unifiedAddressing != 0) {}

  std::string_view name() const override { return "cuda"; }
  std::string DeviceDescription() const override { return description_; }
  cudaStream_t stream() const { return pool_->stream(); }

  absl::Status Synchronize() override {
    RETURN_IF_ERROR(RefuseWhileCapturing("Synchronize"));
    RETURN_IF_ERROR(RefuseWithSideWorkOpen("Synchronize"));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Waits for the stream, then returns the pool's cached blocks, so memory another allocator
    // needs after a load or a long prefill is not held here.
    return pool_->Trim();
  }

  bool CanCapture() const override { return true; }
  // Every NqMoe path adds the low-rank corrections (nq_moe_low_rank.cuh).
  bool AppliesNqLowRank() const override { return true; }

  // Thread-local mode: another thread's unrelated CUDA calls (the streamer's copies into a
  // device arena) neither break this capture nor are refused because of it.
  absl::Status BeginCapture() override {
    if (capturing_) return absl::FailedPreconditionError("BeginCapture: a capture is already open");
    RETURN_IF_ERROR(RefuseWithSideWorkOpen("BeginCapture"));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(pool_->stream(), cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    if (!capturing_) return absl::FailedPreconditionError("EndCapture: no capture is open");
    capturing_ = false;
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Side work left open would leave the side stream's captured ops unjoined, which fails the
    // capture with an opaque error: join it, end the capture, and say why.
    const bool side_was_open = SideWorkOpen();
    if (side_was_open) (void)JoinSideWork();
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(pool_->stream(), &graph);
    if (ended != cudaSuccess) {
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();  // an op's failed launch may have left the sticky-free error set
      return CudaStatus(ended, "cudaStreamEndCapture");
    }
    if (side_was_open) {
      (void)cudaGraphDestroy(graph);
      return absl::FailedPreconditionError("EndCapture: side work was still open (JoinSideWork first)");
    }
    cudaGraphExec_t exec = nullptr;
    // Node priorities: the streams' (StreamPool::Create) hold inside the graph too.
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
    (void)cudaGraphDestroy(graph);
    if (instantiated != cudaSuccess) return CudaStatus(instantiated, "cudaGraphInstantiate");
    return std::unique_ptr<Graph>(new CudaGraph(exec, pool_, device_));
  }

  std::uint64_t CaptureGeneration() const override { return capture_generation_; }

 protected:
  // Side work: ops launch on the pool's current stream (ctx_.stream follows it).
  absl::Status DoBeginSideWork() override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    RETURN_IF_ERROR(pool_->BeginSide());
    ctx_.stream = pool_->current();
    return absl::OkStatus();
  }

  absl::Status DoContinueSideWork() override {
    pool_->ContinueSide();
    ctx_.stream = pool_->current();
    return absl::OkStatus();
  }

  absl::Status DoEndSideWork() override {
    pool_->EndSide();
    ctx_.stream = pool_->current();
    return absl::OkStatus();
  }

  absl::Status DoJoinSideWork() override {
    const absl::Status joined = pool_->JoinSide();
    ctx_.stream = pool_->current();
    return joined;
  }

  absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) override {
    if (bytes == 0) return std::make_unique<DeviceStorage>(nullptr, 0, nullptr);
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    ASSIGN_OR_RETURN(void* data, pool_->Allocate(bytes));
    return std::make_unique<DeviceStorage>(data, bytes, pool_);
  }

  // From pageable memory cudaMemcpyAsync returns once `src` is staged, so the caller may reuse
  // it; the copy itself stays ordered on the stream.
  absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) override {
    RETURN_IF_ERROR(RefuseWhileCapturing("CopyFromHost"));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, pool_->stream()));
    return absl::OkStatus();
  }

  absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) override {
    RETURN_IF_ERROR(RefuseWhileCapturing("CopyToHost"));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, pool_->stream()));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(pool_->stream()));
    return absl::OkStatus();
  }

  absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_.stream));
    return absl::OkStatus();
  }

  absl::Status DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                        const MatMulDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("MatMul", {dims.m, dims.n, dims.k}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchMatMul({.x = x.data_as<float>(),
                         .w = w.data(),
                         .w_dtype = w.dtype(),
                         .y = y.data_as<float>(),
                         .m = static_cast<int>(dims.m),
                         .n = static_cast<int>(dims.n),
                         .k = static_cast<int>(dims.k),
                         .gemv_kernel = gemv_kernel_},
                        ctx_);
  }

  // One GEMV launch per weight dtype present (they are normally all one), each carrying every
  // matrix of that dtype (MatMulParams::extra).
  absl::Status DoMatMulSharedInput(const Tensor& x, std::span<const WeightRef> ws, std::span<Tensor* const> ys,
                                   std::span<const MatMulDims> dims) override {
    static_assert(kMaxSharedInputMatMuls <= kMatMulMaxExtra + 1);
    for (const MatMulDims& d : dims) RETURN_IF_ERROR(CheckIntRange("MatMulSharedInput", {d.m, d.n, d.k}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    auto scales = [](const WeightRef& ref) {
      return ref.scale_inv != nullptr ? ref.scale_inv->data_as<float>() : nullptr;
    };
    bool launched[kMaxSharedInputMatMuls] = {};
    for (std::size_t first = 0; first < ws.size(); ++first) {
      if (launched[first]) continue;
      MatMulParams p{.x = x.data_as<float>(),
                     .w = ws[first].w->data(),
                     .w_dtype = ws[first].w->dtype(),
                     .w_scale = scales(ws[first]),
                     .y = ys[first]->data_as<float>(),
                     .m = static_cast<int>(dims[first].m),
                     .n = static_cast<int>(dims[first].n),
                     .k = static_cast<int>(dims[first].k),
                     .gemv_kernel = gemv_kernel_};
      for (std::size_t i = first + 1; i < ws.size(); ++i) {
        if (ws[i].w->dtype() != p.w_dtype) continue;
        p.extra[p.num_extra++] = MatMulExtra{.w = ws[i].w->data(), .w_scale = scales(ws[i]),
                                             .y = ys[i]->data_as<float>(), .n = static_cast<int>(dims[i].n)};
        launched[i] = true;
      }
      RETURN_IF_ERROR(LaunchMatMul(p, ctx_));
    }
    return absl::OkStatus();
  }

  absl::Status DoMatMulBlockScaled(const Tensor& x, const Tensor& w_fp8, const Tensor& scale_inv,
                                   Tensor& y, const MatMulDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("MatMulBlockScaled", {dims.m, dims.n, dims.k}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchMatMul({.x = x.data_as<float>(),
                         .w = w_fp8.data(),
                         .w_dtype = w_fp8.dtype(),
                         .w_scale = scale_inv.data_as<float>(),
                         .y = y.data_as<float>(),
                         .m = static_cast<int>(dims.m),
                         .n = static_cast<int>(dims.n),
                         .k = static_cast<int>(dims.k)},
                        ctx_);
  }

  absl::Status DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                         const RowDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("RmsNorm", {dims.rows, dims.cols}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchRmsNorm({.x = x.data_as<float>(),
                          .weight = weight.data(),
                          .weight_dtype = weight.dtype(),
                          .y = y.data_as<float>(),
                          .rows = dims.rows,
                          .cols = static_cast<int>(dims.cols),
                          .eps = eps},
                         ctx_);
  }

  absl::Status DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchSiluAndMul(
        {.x = x.data_as<float>(), .y = y.data_as<float>(), .rows = dims.rows, .cols = dims.cols},
        ctx_);
  }

  absl::Status DoSoftmax(const Tensor& x, float scale, Tensor& y,
                         const RowDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("Softmax", {dims.rows, dims.cols}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchSoftmax({.x = x.data_as<float>(),
                          .y = y.data_as<float>(),
                          .rows = dims.rows,
                          .cols = static_cast<int>(dims.cols),
                          .scale = scale},
                         ctx_);
  }

  // ---- Model ops: host spans go to device scratch first (UploadScratch) ----

  absl::Status DoEmbedding(std::span<const std::int32_t> ids, const Tensor& table,
                           Tensor& out) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    ScratchLayout layout;
    const std::size_t ids_at = layout.AddHost(ids);
    ASSIGN_OR_RETURN(std::byte* scratch, UploadScratch(layout));
    return LaunchEmbedding({.ids = reinterpret_cast<const std::int32_t*>(scratch + ids_at),
                            .vocab = table.shape().dim(0),
                            .table = table.data(),
                            .table_dtype = table.dtype(),
                            .out = out.data_as<float>(),
                            .tokens = static_cast<std::int64_t>(ids.size()),
                            .dim = table.shape().dim(1)},
                           ctx_);
  }

  absl::Status DoEmbeddingDevice(const Tensor& ids, const Tensor& table, Tensor& out) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchEmbedding({.ids = ids.data_as<std::int32_t>(),
                            .vocab = table.shape().dim(0),
                            .table = table.data(),
                            .table_dtype = table.dtype(),
                            .out = out.data_as<float>(),
                            .tokens = ids.shape().dim(0),
                            .dim = table.shape().dim(1)},
                           ctx_);
  }

  absl::Status DoAddRmsNorm(Tensor& x, std::span<const Tensor* const> deltas, const Tensor& weight, float eps,
                            Tensor& y, const RowDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("AddRmsNorm", {dims.rows, dims.cols}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    float* const xs = x.data_as<float>();
    float* const ys = y.data_as<float>();
    return LaunchRmsNorm({.x = xs,
                          .weight = weight.data(),
                          .weight_dtype = weight.dtype(),
                          .y = ys,
                          .rows = dims.rows,
                          .cols = static_cast<int>(dims.cols),
                          .eps = eps,
                          .delta0 = deltas[0]->data_as<float>(),
                          .delta1 = deltas.size() > 1 ? deltas[1]->data_as<float>() : nullptr,
                          .x_out = xs == ys ? nullptr : xs},
                         ctx_);
  }

  absl::Status DoAdd(const Tensor& a, const Tensor& b, Tensor& out) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchAdd({.a = a.data_as<float>(),
                      .b = b.data_as<float>(),
                      .out = out.data_as<float>(),
                      .count = out.NumElements()},
                     ctx_);
  }

  absl::Status DoRope(Tensor& x, const StepPosition& start_pos, std::span<const float> inv_freq,
                      float attention_scaling, bool interleaved) override {
    const RopeTarget target{.x = &x, .interleaved = interleaved};
    return DoRopes(std::span<const RopeTarget>(&target, 1), start_pos, inv_freq, attention_scaling);
  }

  // Every target in one launch.
  absl::Status DoRopes(std::span<const RopeTarget> targets, const StepPosition& start_pos,
                       std::span<const float> inv_freq, float attention_scaling) override {
    static_assert(kMaxRopeTargets <= kMaxRopeLaunchTargets);
    RopeParams params{.tokens = targets[0].x->shape().dim(0),
                      .rotary = static_cast<int>(2 * inv_freq.size()),
                      .start_pos = start_pos.bound(),
                      .position = DevicePosition(start_pos),
                      .attention_scaling = attention_scaling};
    for (const RopeTarget& target : targets) {
      Tensor& x = *target.x;
      if (x.NumElements() == 0) continue;  // nothing to rotate (and maybe no memory)
      const std::int64_t heads = x.shape().dim(1);
      const std::int64_t dim = x.shape().dim(2);
      RETURN_IF_ERROR(CheckIntRange("Rope", {heads, dim, heads * dim}));
      params.targets[params.target_count++] = {.x = x.data_as<float>(),
                                               .heads = static_cast<int>(heads),
                                               .dim = static_cast<int>(dim),
                                               .interleaved = target.interleaved};
    }
    if (params.target_count == 0) return absl::OkStatus();
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    ASSIGN_OR_RETURN(params.inv_freq, ConstantOnDevice(inv_freq));
    return LaunchRope(params, ctx_);
  }

  absl::Status DoLayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                           Tensor& y, const RowDims& dims) override {
    RETURN_IF_ERROR(CheckIntRange("LayerNorm", {dims.rows, dims.cols}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchLayerNorm({.x = x.data_as<float>(),
                            .weight = weight.data_as<float>(),
                            .bias = bias.data_as<float>(),
                            .y = y.data_as<float>(),
                            .rows = dims.rows,
                            .cols = static_cast<int>(dims.cols),
                            .eps = eps},
                           ctx_);
  }

  absl::Status DoWriteRows(const Tensor& src, Tensor& dst, const StepPosition& offset) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (dst.dtype() == DType::kU8) {  // packed FP8 rows of the latent cache (kernels/kv_fp8.h)
      return LaunchPackKvFp8Rows({.src = src.data_as<float>(),
                                  .dst = dst.data_as<std::uint8_t>(),
                                  .row_offset = offset.device() != nullptr ? DevicePosition(offset) : nullptr,
                                  .first_row = offset.device() != nullptr ? 0 : offset.bound(),
                                  .rows = src.shape().dim(0),
                                  .c = src.shape().dim(1),
                                  .dst_rows = dst.shape().dim(0)},
                                 ctx_);
    }
    if (offset.device() != nullptr) {
      return LaunchWriteRowsAt({.src = src.data_as<float>(),
                                .dst = dst.data(),
                                .dst_bf16 = dst.dtype() == DType::kBF16,
                                .row_offset = DevicePosition(offset),
                                .rows = src.shape().dim(0),
                                .cols = src.shape().dim(1),
                                .dst_rows = dst.shape().dim(0)},
                               ctx_);
    }
    // The destination rows are contiguous: one copy, or one conversion into a BF16 cache.
    const std::int64_t first = offset.bound() * dst.shape().dim(1);
    if (dst.dtype() == DType::kBF16) {
      return LaunchFloatsToBf16(
          {.src = src.data_as<float>(), .out = dst.data_as<Bf16>() + first, .count = src.NumElements()},
          ctx_);
    }
    float* to = dst.data_as<float>() + first;
    NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, ctx_.stream));
    return absl::OkStatus();
  }

  absl::Status DoGatherRows(const Tensor& x, std::span<const std::int32_t> rows,
                            Tensor& out) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    ScratchLayout layout;
    const std::size_t rows_at = layout.AddHost(rows);
    ASSIGN_OR_RETURN(std::byte* scratch, UploadScratch(layout));
    return LaunchGatherRows({.x = x.data_as<float>(),
                             .rows = reinterpret_cast<const std::int32_t*>(scratch + rows_at),
                             .out = out.data_as<float>(),
                             .n = static_cast<std::int64_t>(rows.size()),
                             .cols = x.shape().dim(1)},
                            ctx_);
  }

  absl::Status DoScatterAddRows(const Tensor& src, std::span<const std::int32_t> rows,
                                std::span<const float> weights, Tensor& out) override {
    const std::int64_t n = static_cast<std::int64_t>(rows.size());
    RETURN_IF_ERROR(CheckIntRange("ScatterAddRows", {n}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Group the contributions by target row, keeping index order within a row (stable sort).
    std::vector<std::int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t a, std::int32_t b) { return rows[a] < rows[b]; });
    std::vector<std::int32_t> targets;
    std::vector<std::int32_t> offsets;
    std::vector<float> sorted_weights(n);
    for (std::int64_t e = 0; e < n; ++e) {
      if (e == 0 || rows[order[e]] != rows[order[e - 1]]) {
        targets.push_back(rows[order[e]]);
        offsets.push_back(static_cast<std::int32_t>(e));
      }
      sorted_weights[e] = weights[order[e]];
    }
    offsets.push_back(static_cast<std::int32_t>(n));
    ScratchLayout layout;
    const std::size_t targets_at = layout.AddHost(std::span<const std::int32_t>(targets));
    const std::size_t offsets_at = layout.AddHost(std::span<const std::int32_t>(offsets));
    const std::size_t sources_at = layout.AddHost(std::span<const std::int32_t>(order));
    const std::size_t weights_at = layout.AddHost(std::span<const float>(sorted_weights));
    ASSIGN_OR_RETURN(std::byte* scratch, UploadScratch(layout));
    return LaunchScatterAddRows(
        {.src = src.data_as<float>(),
         .targets = reinterpret_cast<const std::int32_t*>(scratch + targets_at),
         .offsets = reinterpret_cast<const std::int32_t*>(scratch + offsets_at),
         .sources = reinterpret_cast<const std::int32_t*>(scratch + sources_at),
         .weights = reinterpret_cast<const float*>(scratch + weights_at),
         .out = out.data_as<float>(),
         .num_targets = static_cast<std::int64_t>(targets.size()),
         .cols = src.shape().dim(1)},
        ctx_);
  }

  absl::Status DoMlaAttention(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_latent,
                              const Tensor& k_pe, const Tensor& w_uk, const Tensor& w_uv,
                              const Tensor* selected, const StepPosition& start_pos, float scale,
                              Tensor& out) override {
    const std::int64_t tokens = q_nope.shape().dim(0);
    const std::int64_t heads = q_nope.shape().dim(1);
    const std::int64_t top_k = selected != nullptr ? selected->shape().dim(1) : 0;
    RETURN_IF_ERROR(CheckIntRange(
        "MlaAttention", {tokens, heads, tokens * heads, q_nope.shape().dim(2),
                         q_pe.shape().dim(2), kv_latent.shape().dim(0), kv_latent.shape().dim(1),
                         w_uv.shape().dim(1), top_k}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const MlaAttentionParams params{
        .q_nope = q_nope.data_as<float>(),
         .q_pe = q_pe.data_as<float>(),
         .kv_latent = kv_latent.data(),
         .k_pe = k_pe.data(),
         .kv_dtype = kv_latent.dtype(),
         .w_uk = w_uk.data(),
         .w_uk_dtype = w_uk.dtype(),
         .w_uv = w_uv.data(),
         .w_uv_dtype = w_uv.dtype(),
         .selected = selected != nullptr ? selected->data_as<std::int32_t>() : nullptr,
         .out = out.data_as<float>(),
         .tokens = static_cast<int>(tokens),
         .heads = static_cast<int>(heads),
         .dn = static_cast<int>(q_nope.shape().dim(2)),
         .dr = static_cast<int>(q_pe.shape().dim(2)),
         .c = static_cast<int>(w_uk.shape().dim(2)),  // packed FP8 rows are wider than c
         .dv = static_cast<int>(w_uv.shape().dim(1)),
         .top_k = static_cast<int>(top_k),
         .start_pos = static_cast<int>(start_pos.bound()),  // < keys, checked above
         .position = DevicePosition(start_pos),
         .scale = scale};
    // A few queries (decode, MTP verification): the split kernels share each key read among the
    // heads and spread the keys over the GPU; the per-(query, head) kernel otherwise.
    if (!MlaDecodeApplies(params)) return LaunchMlaAttention(params, ctx_);
    const MlaDecodePlan plan = PlanMlaDecode(params, ctx_.num_sms);
    ScratchLayout layout;
    const std::size_t work_at = layout.AddDevice(plan.ScratchBytes());
    ASSIGN_OR_RETURN(std::byte* scratch, UploadScratch(layout));
    return LaunchMlaDecode(params, plan, scratch + work_at, plan.ScratchBytes(), ctx_);
  }

  absl::Status DoSampleTokens(const Tensor& logits, const Tensor& params, Tensor& ids) override {
    RETURN_IF_ERROR(CheckIntRange("SampleTokens", {logits.shape().dim(0)}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchSampleTokens({.logits = logits.data_as<float>(),
                               .params = reinterpret_cast<const SampleParams*>(params.data_as<std::uint8_t>()),
                               .ids = ids.data_as<std::int32_t>(),
                               .rows = logits.shape().dim(0),
                               .vocab = logits.shape().dim(1)},
                              ctx_);
  }

  absl::Status DoMoeRoute(const Tensor& logits, const Tensor* bias, const MoeRouteParams& params, Tensor& ids,
                          Tensor& weights) override {
    RETURN_IF_ERROR(CheckIntRange("MoeRoute", {logits.shape().dim(0)}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchMoeRoute({.logits = logits.data_as<float>(),
                           .bias = bias != nullptr ? bias->data_as<float>() : nullptr,
                           .ids = ids.data_as<std::int32_t>(),
                           .weights = weights.data_as<float>(),
                           .tokens = logits.shape().dim(0),
                           .params = params},
                          ctx_);
  }

  absl::Status DoApplySlotMailbox(const SlotMailboxRow& row, Tensor& applied, Tensor& slot_of_expert) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return LaunchApplySlotMailbox(row, static_cast<std::uint64_t*>(applied.data()),
                                  slot_of_expert.data_as<std::int32_t>(), ctx_);
  }

  absl::StatusOr<std::unique_ptr<Storage>> AllocateHostStagingStorage(std::size_t bytes) override {
    ASSIGN_OR_RETURN(PinnedHostBuffer buffer, PinnedHostBuffer::Allocate(std::max<std::size_t>(bytes, 1)));
    return std::unique_ptr<Storage>(new PinnedStorage(std::move(buffer), bytes, pinned_ranges_));
  }

  // On the side stream too: into page-locked memory the copy shares nothing with the main stream
  // (the model's routing log copies there, off the critical path of every MoE layer).
  // A small copy into this backend's own staging is a kernel storing into it (mapped_host_copy.cuh:
  // no copy node in a step's graph, and the kernel after it still launches programmatically);
  // larger copies, and any destination the backend did not stage (pageable memory a kernel must
  // never touch), take the copy engine.
  absl::Status DoCopyToHostAsync(const void* src, std::size_t bytes, void* dst) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (kernel_host_copies_ && bytes <= kMappedHostCopyMaxBytes && pinned_ranges_->Contains(dst, bytes)) {
      return LaunchMappedHostCopy(src, dst, bytes, ctx_);
    }
    NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream));
    return absl::OkStatus();
  }

  absl::Status DoIndexerTopK(const Tensor& q, const Tensor& k, const Tensor& weights,
                             const StepPosition& start, Tensor& selected) override {
    const std::int64_t tokens = q.shape().dim(0);
    const std::int64_t start_pos = start.bound();  // sizes the scratch; the kernels read a device one
    const std::int64_t visible_max = start_pos + tokens;
    RETURN_IF_ERROR(CheckIndexerShape(visible_max, q.shape().dim(1), q.shape().dim(2),
                                      selected.shape().dim(1)));
    RETURN_IF_ERROR(CheckIntRange("IndexerTopK", {tokens, q.shape().dim(1), q.shape().dim(2),
                                                  selected.shape().dim(1)}));
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const std::int64_t row_bytes = visible_max * static_cast<std::int64_t>(sizeof(float));
    const std::int64_t score_rows = std::clamp<std::int64_t>(
        static_cast<std::int64_t>(kIndexerScoreBytes) / row_bytes, 1, tokens);
    ScratchLayout layout;
    const std::size_t scores_at =
        layout.AddDevice(static_cast<std::size_t>(score_rows * row_bytes));
    // Decode's multi-block selection lists (0 bytes for a prefill chunk).
    const std::int64_t select_bytes =
        IndexerSelectScratchBytes(tokens, visible_max, selected.shape().dim(1));
    const std::size_t select_at = layout.AddDevice(static_cast<std::size_t>(select_bytes));
    ASSIGN_OR_RETURN(std::byte* scratch, UploadScratch(layout));
    return LaunchIndexerTopK({.q = q.data_as<float>(),
                              .k = k.data_as<float>(),
                              .weights = weights.data_as<float>(),
                              .selected = selected.data_as<std::int32_t>(),
                              .scores = reinterpret_cast<float*>(scratch + scores_at),
                              .tokens = static_cast<int>(tokens),
                              .heads = static_cast<int>(q.shape().dim(1)),
                              .dim = static_cast<int>(q.shape().dim(2)),
                              .top_k = static_cast<int>(selected.shape().dim(1)),
                              .start_pos = static_cast<int>(start_pos),
                              .position = DevicePosition(start),
                              .score_rows = static_cast<int>(score_rows),
                              .select_scratch = select_bytes > 0 ? scratch + select_at : nullptr},
                             ctx_);
  }

  absl::Status DoNqMoe(const NqMoeParams& params) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Up to a few tokens (decode, MTP verification) the GEMV path reads each expert once per
    // 4 tokens; from 16 the grouped tensor-core path reads it once per 64-token tile; with enough
    // tokens per expert, each expert is dequantised once and its tokens run through cuBLAS.
    if (params.tokens >= kNqPrefillMinTokens && NqMoeDensePrefillPays(params)) return DenseNqMoe(params);
    const bool prefill = params.tokens >= kNqPrefillMinTokens && NqMoePrefillSupports(params);
    const std::size_t bytes =
        prefill ? NqMoePrefillWorkspaceBytes(params.top_k, params.hidden, params.intermediate, params.num_experts)
                : NqMoeWorkspaceBytes(params.top_k, params.hidden, params.intermediate);
    RETURN_IF_ERROR(GrowNqMoeWorkspace(bytes));
    return prefill ? LaunchNqMoePrefill(params, nq_moe_workspace_.get(), nq_moe_workspace_.bytes(), ctx_)
                   : LaunchNqMoe(params, nq_moe_workspace_.get(), nq_moe_workspace_.bytes(), ctx_);
  }

  // NVFP4 experts (kernels/nvfp4_moe.h): the decode GEMV path (longer inputs as chunks of
  // kNvfp4MaxDecodeTokens), or, with enough tokens per expert, each expert dequantised once and
  // its tokens run through cuBLAS; in the NestQuant op's workspace.
  absl::Status DoNvfp4Moe(const Nvfp4MoeParams& params) override {
    NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (Nvfp4MoeDensePrefillPays(params)) return DenseNvfp4Moe(params);
    RETURN_IF_ERROR(GrowNqMoeWorkspace(Nvfp4MoeWorkspaceBytes(params.top_k, params.hidden, params.intermediate)));
    return LaunchNvfp4Moe(params, nq_moe_workspace_.get(), nq_moe_workspace_.bytes(), ctx_);
  }

  absl::Status GrowNqMoeWorkspace(std::size_t bytes) {
    // The workspace serves every MoE op, ordered by the one stream they share.
    RETURN_IF_ERROR(RefuseOnSide("an MoE op (it uses the backend's workspace)"));
    if (bytes <= nq_moe_workspace_.bytes()) return absl::OkStatus();
    // Growing waits for the stream: kernels enqueued earlier may still use the old block. A
    // captured decode graph sizes it before capture (its first, uncaptured step).
    RETURN_IF_ERROR(RefuseWhileCapturing("growing the MoE workspace"));
    NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(pool_->stream()));
    ++capture_generation_;
    const std::size_t grown = GrownCapacity(bytes, nq_moe_workspace_.bytes());
    nq_moe_workspace_.Reset();
    ASSIGN_OR_RETURN(nq_moe_workspace_, DeviceBuffer::Allocate(grown));
    return absl::OkStatus();
  }

  // The long-prefill paths' cuBLAS handle, side stream and events, made on first use (most
  // workers prefill long prompts sooner or later; a decode-only process never pays for them),
  // and a pinned host buffer for num_experts' group sizes.
  absl::StatusOr<DensePrefillResources> DensePrefillResourcesFor(std::int64_t num_experts) {
    if (blas_.get() == nullptr) {
      ASSIGN_OR_RETURN(blas_, BlasHandle::Create());
      ASSIGN_OR_RETURN(side_stream_, CudaStream::CreateNonBlocking());
      for (CudaEvent* event : {&dense_start_, &dense_ready_[0], &dense_ready_[1], &dense_free_[0], &dense_free_[1]}) {
        ASSIGN_OR_RETURN(*event, CudaEvent::Create());
      }
    }
    const std::size_t host_bytes = 2 * static_cast<std::size_t>(num_experts) * sizeof(int);
    if (dense_host_.bytes() < host_bytes) {
      ASSIGN_OR_RETURN(dense_host_, PinnedHostBuffer::Allocate(host_bytes));
    }
    return DensePrefillResources{.blas = blas_.get(),
                                 .side = side_stream_.get(),
                                 .start = dense_start_.get(),
                                 .ready = {dense_ready_[0].get(), dense_ready_[1].get()},
                                 .free = {dense_free_[0].get(), dense_free_[1].get()},
                                 .host_counts = static_cast<int*>(dense_host_.get()),
                                 .host_capacity = static_cast<std::int64_t>(dense_host_.bytes() / sizeof(int))};
  }

  // Long prefills: chunks of kNqDensePrefillChunk tokens through LaunchNqMoeDensePrefill.
  absl::Status DenseNqMoe(const NqMoeParams& params) {
    RETURN_IF_ERROR(GrowNqMoeWorkspace(
        NqMoeDensePrefillWorkspaceBytes(params.top_k, params.hidden, params.intermediate, params.num_experts)));
    ASSIGN_OR_RETURN(const DensePrefillResources resources, DensePrefillResourcesFor(params.num_experts));
    for (std::int64_t t0 = 0; t0 < params.tokens; t0 += kNqDensePrefillChunk) {
      const NqMoeParams chunk = NqMoeTokenChunk(params, t0, std::min(kNqDensePrefillChunk, params.tokens - t0));
      RETURN_IF_ERROR(
          LaunchNqMoeDensePrefill(chunk, nq_moe_workspace_.get(), nq_moe_workspace_.bytes(), resources, ctx_));
    }
    return absl::OkStatus();
  }

  // The same for NVFP4 experts: chunks of kNvfp4DensePrefillChunk tokens.
  absl::Status DenseNvfp4Moe(const Nvfp4MoeParams& params) {
    RETURN_IF_ERROR(GrowNqMoeWorkspace(Nvfp4MoeDensePrefillWorkspaceBytes(
        params.tokens, params.top_k, params.hidden, params.intermediate, params.num_experts)));
    ASSIGN_OR_RETURN(const DensePrefillResources resources, DensePrefillResourcesFor(params.num_experts));
    for (std::int64_t t0 = 0; t0 < params.tokens; t0 += kNvfp4DensePrefillChunk) {
      const Nvfp4MoeParams chunk =
          Nvfp4MoeTokenChunk(params, t0, std::min(kNvfp4DensePrefillChunk, params.tokens - t0));
      RETURN_IF_ERROR(
          LaunchNvfp4MoeDensePrefill(chunk, nq_moe_workspace_.get(), nq_moe_workspace_.bytes(), resources, ctx_));
    }
    return absl::OkStatus();
  }

 private:
  // Makes the scratch block at least layout.total_bytes() long and enqueues the copy of the
  // layout's host staging into its start; returns the block. Growing waits for the stream first:
  // kernels enqueued earlier may still read the old block.
  // A model passes the same few host constants (RoPE frequencies) to every call: upload each
  // distinct one once instead of a host-to-device copy per call. At most kMaxConstants are
  // kept; replacing one frees it with cudaFree, which waits for the kernels still reading it.
  absl::StatusOr<const float*> ConstantOnDevice(std::span<const float> values) {
    for (const DeviceConstant& c : constants_) {
      if (c.host.size() == values.size() && std::equal(values.begin(), values.end(), c.host.begin())) {
        return static_cast<const float*>(c.device.get());
      }
    }
    constexpr std::size_t kMaxConstants = 8;
    RETURN_IF_ERROR(RefuseWhileCapturing("uploading a constant"));
    if (constants_.size() == kMaxConstants) {
      constants_.erase(constants_.begin());
      ++capture_generation_;
    }
    DeviceConstant c;
    c.host.assign(values.begin(), values.end());
    ASSIGN_OR_RETURN(c.device, DeviceBuffer::Allocate(std::max<std::size_t>(values.size_bytes(), 1)));
    if (!values.empty()) {
      // On the op stream, so the kernels enqueued after it see the values. With side work open
      // the other stream will read it too without being ordered after this copy: wait for it
      // (once per distinct constant).
      NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(c.device.get(), values.data(), values.size_bytes(),
                                              cudaMemcpyHostToDevice, ctx_.stream));
      if (SideWorkOpen()) NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx_.stream));
    }
    constants_.push_back(std::move(c));
    return static_cast<const float*>(constants_.back().device.get());
  }

  absl::StatusOr<std::byte*> UploadScratch(const ScratchLayout& layout) {
    // One scratch block serves every op, ordered by the one stream they share.
    RETURN_IF_ERROR(RefuseOnSide("an op using the backend's scratch"));
    if (layout.total_bytes() > scratch_.bytes() || !layout.staging().empty()) {
      // Growing waits for the device; host staging would be captured as a copy from memory that
      // is gone when the graph replays.
      RETURN_IF_ERROR(RefuseWhileCapturing("an op with host inputs or a larger scratch"));
    }
    if (layout.total_bytes() > scratch_.bytes()) {
      NQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(pool_->stream()));
      ++capture_generation_;
      const std::size_t grown = GrownCapacity(std::max(layout.total_bytes(), kMinScratchBytes), scratch_.bytes());
      scratch_.Reset();
      ASSIGN_OR_RETURN(scratch_, DeviceBuffer::Allocate(grown));
    }
    auto* scratch = static_cast<std::byte*>(scratch_.get());
    const std::vector<std::byte>& staging = layout.staging();
    if (!staging.empty()) {
      // From pageable memory this returns once `staging` is staged; the copy stays stream-ordered.
      NQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scratch, staging.data(), staging.size(),
                                              cudaMemcpyHostToDevice, pool_->stream()));
    }
    return scratch;
  }

  // The device pointer a kernel reads a StepPosition from, or null for a host position.
  static const std::int32_t* DevicePosition(const StepPosition& p) {
    return p.device() != nullptr ? p.device()->data_as<std::int32_t>() : nullptr;
  }

  absl::Status RefuseWhileCapturing(absl::string_view what) const {
    if (!capturing_) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        what, " cannot be captured in a CUDA graph (it reads host memory at enqueue or waits for the device)"));
  }

  int device_;
  DecodeGemv gemv_kernel_;  // BackendOptions::cuda_decode_gemv
  std::string description_;
  bool capturing_ = false;
  std::uint64_t capture_generation_ = 0;  // CaptureGeneration()
  std::shared_ptr<StreamPool> pool_;  // the stream every op runs on, and tensor memory
  LaunchContext ctx_;
  // Unified addressing: page-locked staging is device-addressable, so small copies into it may be
  // kernels (DoCopyToHostAsync). pinned_ranges_ lists that staging; each PinnedStorage holds it.
  bool kernel_host_copies_ = false;
  std::shared_ptr<PinnedRanges> pinned_ranges_ = std::make_shared<PinnedRanges>();
  DeviceBuffer scratch_;  // one op's host inputs and intermediates (UploadScratch)
  struct DeviceConstant {
    std::vector<float> host;
    DeviceBuffer device;
  };
  std::vector<DeviceConstant> constants_;  // ConstantOnDevice
  DeviceBuffer nq_moe_workspace_;  // NqMoe's intermediates (grow-only)
  // The dense prefill's resources (DenseNqMoe).
  BlasHandle blas_;
  CudaStream side_stream_;
  CudaEvent dense_start_, dense_ready_[2], dense_free_[2];
  PinnedHostBuffer dense_host_;
};

}  // namespace

void* NativeStream(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? static_cast<void*>(cuda->stream()) : nullptr;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device, DecodeGemv decode_gemv) {
  int count = 0;
  const cudaError_t count_error = cudaGetDeviceCount(&count);
  if (count_error != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: ",
                     count_error != cudaSuccess
                         ? CudaStatus(count_error, "cudaGetDeviceCount").message()
                         : "cudaGetDeviceCount found none"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " requested, ", count, " visible"));
  }
  NQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp props{};
  NQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, device));
  cudaFuncAttributes probe{};
  const cudaError_t probe_error = cudaFuncGetAttributes(&probe, ProbeKernel);
  if (probe_error != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA kernels cannot run on ", props.name, " (sm_", props.major, props.minor,
        "; this build targets CMAKE_CUDA_ARCHITECTURES, sm_90a by default): ",
        CudaStatus(probe_error, "cudaFuncGetAttributes").message()));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<StreamPool> pool, StreamPool::Create(device));
  return std::make_unique<CudaBackend>(device, props, std::move(pool), decode_gemv);
}

}  // namespace nq::kernels::cuda
