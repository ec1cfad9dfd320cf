// LaunchMatMul: picks the kernel (GEMV for each m up to kGemvMaxRows, or tiled with a tile size)
// and the weight dtype's instantiation through one table lookup.
#include "kernels/cuda/matmul.cuh"

#include <algorithm>
#include <array>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/matmul_gemv_mma.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

using Launcher = absl::Status (*)(const MatMulParams&, const LaunchContext&);

// Launches a GEMV kernel over row_blocks 32-row blocks and `splits` column ranges: a
// programmatic dependent (its first weight loads are issued while the kernel before it
// finishes), with splits one thread-block cluster per 32 rows.
template <typename Kernel>
absl::Status LaunchGemvGrid(Kernel kernel, const MatMulParams& p, std::int64_t row_blocks, int splits,
                            const LaunchContext& ctx) {
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = 1;
  attributes[1].val.clusterDim.y = static_cast<unsigned>(splits);
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(splits));
  config.blockDim = dim3(kGemvThreads);
  config.stream = ctx.stream;
  config.attrs = attributes;
  config.numAttrs = splits > 1 ? 2 : 1;
  MatMulParams launched = p;
  launched.early_dependents = GemvGridFitsOneWave(row_blocks * splits, ctx.num_sms);
  return CudaStatus(cudaLaunchKernelEx(&config, kernel, launched), "launching the GEMV");
}

// The split count: forced (benchmarks) or GemvSplits' choice, over `col_steps` steps of columns.
int ChooseSplits(const MatMulParams& p, std::int64_t row_blocks, int col_steps, const LaunchContext& ctx) {
  return p.k_splits > 0 ? std::clamp(std::min(p.k_splits, col_steps), 1, kGemvMaxSplits)
                        : GemvSplits(static_cast<int>(row_blocks), col_steps, ctx.num_sms);
}

template <typename WeightT, int kM>
absl::Status LaunchGemv(const MatMulParams& p, const LaunchContext& ctx) {
  // Every matrix's 32-row blocks, one after another (matmul_gemv.cuh, GemvMatrixOf).
  std::int64_t row_blocks = CeilDiv(p.n, kGemvRowsPerBlock);
  for (int e = 0; e < p.num_extra; ++e) row_blocks += CeilDiv(p.extra[e].n, kGemvRowsPerBlock);
  if (row_blocks > kMaxGridX) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul: ", row_blocks, " row blocks exceed one launch"));
  }
  // BF16 matrices of whole 16-byte rows whose blocks fill the SMs take the tensor cores whatever
  // m is (the choice depends on the matrix and the device alone, so a token's outputs do not
  // depend on how many share the pass).
  if constexpr (std::is_same_v<WeightT, Bf16>) {
    const bool tensor = p.gemv_kernel == DecodeGemv::kTensorCores ||
                        (p.gemv_kernel == DecodeGemv::kAuto && MmaGemvPays(row_blocks, ctx.num_sms));
    if (tensor && MmaGemvReads(p)) {
      const int steps = static_cast<int>(CeilDiv(p.k, kMmaGemvStepCols));
      return LaunchGemvGrid(&MatMulGemvMmaKernel<kM>, p, row_blocks, ChooseSplits(p, row_blocks, steps, ctx), ctx);
    }
  }
  // Each row of x and w starts 16-byte aligned when the bases are and k fills whole vectors.
  bool vectorized = p.k % kVec16<WeightT> == 0 && IsAligned(p.w, 16) && IsAligned(p.x, 16);
  for (int e = 0; e < p.num_extra; ++e) vectorized = vectorized && IsAligned(p.extra[e].w, 16);
  const int col_steps = static_cast<int>(CeilDiv(p.k, kWarpSize * kVec16<WeightT>));
  auto* kernel = vectorized ? &MatMulGemvKernel<WeightT, kM, true> : &MatMulGemvKernel<WeightT, kM, false>;
  return LaunchGemvGrid(kernel, p, row_blocks, ChooseSplits(p, row_blocks, col_steps, ctx), ctx);
}

template <typename Tile, typename WeightT>
absl::Status LaunchTiled(const MatMulParams& p, const LaunchContext& ctx) {
  const std::int64_t tiles_m = CeilDiv(p.m, Tile::kBlockM);
  if (tiles_m > kMaxGridY) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul: m = ", p.m, " exceeds the ",
                                                   kMaxGridY * Tile::kBlockM,
                                                   " rows one launch can cover"));
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.n, Tile::kBlockN)),
                  static_cast<unsigned>(tiles_m));
  MatMulTiledKernel<Tile, WeightT><<<grid, Tile::kThreads, 0, ctx.stream>>>(p);
  return CheckLaunch("MatMulTiledKernel");
}

// Paths 0 .. kGemvMaxRows - 1 are the GEMV for m = path + 1; then the two tile shapes.
constexpr int kPathTileSmall = kGemvMaxRows;
constexpr int kPathTileLarge = kGemvMaxRows + 1;
constexpr int kNumPaths = kGemvMaxRows + 2;

static_assert(kGemvMaxRows == 8, "kPaths lists one GEMV launcher per m");
template <typename WeightT>
constexpr std::array<Launcher, kNumPaths> kPaths = {
    &LaunchGemv<WeightT, 1>, &LaunchGemv<WeightT, 2>, &LaunchGemv<WeightT, 3>,
    &LaunchGemv<WeightT, 4>, &LaunchGemv<WeightT, 5>, &LaunchGemv<WeightT, 6>,
    &LaunchGemv<WeightT, 7>, &LaunchGemv<WeightT, 8>, &LaunchTiled<GemmTileSmall, WeightT>,
    &LaunchTiled<GemmTileLarge, WeightT>};

// The weight dtypes a MatMul kernel reads, in kLaunchers' row order.
constexpr int kNumWeightDTypes = 4;
constexpr std::array<Launcher, kNumPaths> kLaunchers[kNumWeightDTypes] = {
    kPaths<float>, kPaths<Bf16>, kPaths<F16>, kPaths<F8E4M3>};

// kLaunchers' row for `dtype`, or -1 when no kernel reads it.
int WeightRow(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 0;
    case DType::kBF16: return 1;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 3;
    case DType::kI32:
    case DType::kU8:
      break;
  }
  return -1;
}

}  // namespace

int GemvSplits(int row_blocks, int col_steps, int num_sms) {
  // Measured on the H200 (bench/README.md, gemv_bench): a memory-bound GEMV with at least one
  // 32-row block per SM runs best unsplit (o_proj's 192 blocks: 0.82 of copy unsplit, 0.73 in
  // 4), since each split re-stages x and ends in a cluster barrier; with fewer blocks than SMs,
  // enough splits to give every SM one (576 rows: 0.09 of copy unsplit, 0.30 in 8).
  num_sms = std::max(num_sms, 1);
  if (row_blocks >= num_sms) return 1;
  const int wanted = static_cast<int>(CeilDiv(num_sms, std::max(row_blocks, 1)));
  return std::clamp(std::min(wanted, col_steps), 1, kGemvMaxSplits);
}

namespace {

int ChoosePath(const MatMulParams& p, int num_sms) {
  if (p.m <= kGemvMaxRows) return p.m - 1;
  // Large tiles only once they alone give every SM a block; otherwise small tiles spread the
  // work wider.
  const std::int64_t large_tiles = CeilDiv(p.m, GemmTileLarge::kBlockM) *
                                   CeilDiv(p.n, GemmTileLarge::kBlockN);
  return large_tiles >= num_sms ? kPathTileLarge : kPathTileSmall;
}

}  // namespace

absl::Status LaunchMatMul(const MatMulParams& p, const LaunchContext& ctx) {
  if (p.m < 0 || p.n < 0 || p.k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatMul: negative size m=", p.m, " n=", p.n, " k=", p.k));
  }
  const int row = WeightRow(p.w_dtype);
  if (row < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatMul: no CUDA kernel for weights of dtype ", DTypeName(p.w_dtype)));
  }
  // (An FP8 weight with k == 0 has empty scales, which live at a null address.)
  if ((p.w_dtype == DType::kF8E4M3) != (p.w_scale != nullptr) && p.k > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MatMul: block scales go with F8_E4M3 weights and only with them (weights are ",
        DTypeName(p.w_dtype), ", scales ", p.w_scale != nullptr ? "given" : "missing", ")"));
  }
  if (p.num_extra < 0 || p.num_extra > kMatMulMaxExtra) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul: ", p.num_extra, " extra matrices (at most ", kMatMulMaxExtra, ")"));
  }
  for (int e = 0; e < p.num_extra; ++e) {
    const MatMulExtra& extra = p.extra[e];
    if (extra.n <= 0 || extra.w == nullptr || extra.y == nullptr ||
        ((p.w_dtype == DType::kF8E4M3) != (extra.w_scale != nullptr) && p.k > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("MatMul: extra matrix ", e, " of ", extra.n,
                                                     " rows lacks its weights, output or scales"));
    }
  }
  if (p.m == 0 || p.n == 0) return absl::OkStatus();
  if (p.k == 0) {  // an empty sum: zeros, whatever the kernels' loops would (not) write
    NQ_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.y, 0, sizeof(float) * static_cast<std::size_t>(p.m) * p.n, ctx.stream));
    for (int e = 0; e < p.num_extra; ++e) {
      NQ_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.extra[e].y, 0, sizeof(float) * static_cast<std::size_t>(p.m) * p.extra[e].n,
                                              ctx.stream));
    }
    return absl::OkStatus();
  }
  const int path = ChoosePath(p, ctx.num_sms);
  if (path < kGemvMaxRows || p.num_extra == 0) return kLaunchers[row][path](p, ctx);
  // The tiled kernel fills the GPU with one matrix's tiles: the matrices run one by one.
  MatMulParams one = p;
  one.num_extra = 0;
  RETURN_IF_ERROR(kLaunchers[row][path](one, ctx));
  for (int e = 0; e < p.num_extra; ++e) {
    one.w = p.extra[e].w;
    one.w_scale = p.extra[e].w_scale;
    one.y = p.extra[e].y;
    one.n = p.extra[e].n;
    RETURN_IF_ERROR(kLaunchers[row][ChoosePath(one, ctx.num_sms)](one, ctx));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cuda
