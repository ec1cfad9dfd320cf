// LaunchMatMul: picks the kernel (GEMV or tiled, tile size) and the weight dtype's instantiation
// through one table lookup.
#include "kernels/cuda/matmul.cuh"

#include "absl/strings/str_cat.h"

namespace nq::kernels::cuda {
namespace {

using Launcher = absl::Status (*)(const MatMulParams&, const LaunchContext&);

template <typename WeightT>
absl::Status LaunchGemv(const MatMulParams& p, const LaunchContext& ctx) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.n, kGemvWarps)));
  // Each row of x and w starts 16-byte aligned when the bases are and k fills whole vectors.
  const bool vectorized = p.k % kVec16<WeightT> == 0 && IsAligned(p.w, 16) && IsAligned(p.x, 16);
  if (vectorized) {
    MatMulGemvKernel<WeightT, true><<<grid, kGemvThreads, 0, ctx.stream>>>(p);
  } else {
    MatMulGemvKernel<WeightT, false><<<grid, kGemvThreads, 0, ctx.stream>>>(p);
  }
  return CheckLaunch("MatMulGemvKernel");
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

enum Path : int { kPathGemv, kPathTileSmall, kPathTileLarge, kNumPaths };

static_assert(static_cast<int>(DType::kF32) == 0 && static_cast<int>(DType::kBF16) == 1 &&
              static_cast<int>(DType::kF16) == 2, "kLaunchers rows follow DType's order");
constexpr int kNumWeightDTypes = 3;

constexpr Launcher kLaunchers[kNumWeightDTypes][kNumPaths] = {
    {&LaunchGemv<float>, &LaunchTiled<GemmTileSmall, float>,
     &LaunchTiled<GemmTileLarge, float>},
    {&LaunchGemv<Bf16>, &LaunchTiled<GemmTileSmall, Bf16>, &LaunchTiled<GemmTileLarge, Bf16>},
    {&LaunchGemv<F16>, &LaunchTiled<GemmTileSmall, F16>, &LaunchTiled<GemmTileLarge, F16>},
};

Path ChoosePath(const MatMulParams& p, int num_sms) {
  if (p.m <= kGemvMaxRows) return kPathGemv;
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
  const int dtype = static_cast<int>(p.w_dtype);
  if (dtype < 0 || dtype >= kNumWeightDTypes) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatMul: no CUDA kernel for weights of dtype ", DTypeName(p.w_dtype)));
  }
  if (p.m == 0 || p.n == 0) return absl::OkStatus();
  return kLaunchers[dtype][ChoosePath(p, ctx.num_sms)](p, ctx);
}

}  // namespace nq::kernels::cuda
