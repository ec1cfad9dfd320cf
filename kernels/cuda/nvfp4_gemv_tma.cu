#include "kernels/cuda/nvfp4_gemv_tma.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/nvfp4_fragment.h"
#include "kernels/cuda/nvfp4_gemv_step.cuh"
#include "kernels/nvfp4_codes.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cuda {
namespace {

using namespace nvfp4_gemv;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
// A code box is one 128-byte swizzle span of 16 rows: two steps of each row's codes. With the
// 128-byte swizzle, 16-byte chunk c of box row r sits at chunk c ^ (r % 8), so the eight rows a
// warp's lanes read in one load fall on different banks.
constexpr int kBoxRowBytes = 128;
constexpr int kBoxBytes = kBoxRowBytes * kMmaRows;
constexpr int kStepRowBytes = nvfp4::kStepCols / 2;                      // 64
constexpr int kStepScaleBytes = nvfp4::kStepCols / kNvfp4BlockSize;      // 8
constexpr int kSwizzleAlign = 1024;  // the 128-byte swizzle's pattern repeats every 1024 bytes

struct TmaParams {
  CUtensorMap codes;   // [E * rows][cols / 2] bytes; boxes of 16 rows x 128 bytes, 128-byte swizzle
  // [E * rows][cols / 16] bytes; boxes of 16 rows x a stage's scale bytes: 2-step stages, and
  // 4-step stages (encoded where cols is a multiple of 4 steps).
  CUtensorMap scales[2];
  Nvfp4GemvParams g;
};

// Shared memory of one block: the warps' mbarriers (kMaxStages each) in the alignment slack, then
// from the first 1024-byte boundary each warp's ring of kStages stages (codes), then their scales.
constexpr int kMaxStages = 3;
constexpr int kBarrierBytes = kWarps * kMaxStages * 8;
static_assert(kBarrierBytes <= kSwizzleAlign);

template <int kStageSteps, int kStages>
struct Ring {
  static_assert(kStageSteps % 2 == 0 && kStages <= kMaxStages);
  static constexpr int kCodeBytes = kStageSteps / 2 * kBoxBytes;               // a stage's codes
  static constexpr int kScaleRowBytes = kStageSteps * kStepScaleBytes;
  static constexpr int kScaleBytes = kMmaRows * kScaleRowBytes;                // a stage's scales
  static constexpr int kScalesOffset = kWarps * kStages * kCodeBytes;
  static constexpr int kBytes = kScalesOffset + kWarps * kStages * kScaleBytes;
};

// Dynamic shared memory for rings of ring_bytes: the barriers, then alignment for the rings
// (dynamic shared memory starts 16-byte aligned).
constexpr std::size_t SmemBytes(int ring_bytes) { return 2 * kSwizzleAlign + ring_bytes; }

__device__ __forceinline__ std::uint32_t SharedAddress(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarrierInit(std::uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

// The stage's one arrival, announcing the bytes its copies will complete.
__device__ __forceinline__ void BarrierArriveExpect(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void BarrierWait(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Box (x bytes, row y) of map into shared memory at dst, completing on bar.
__device__ __forceinline__ void TmaLoad(std::uint32_t dst, const CUtensorMap& map, int x, int y, std::uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<std::uint64_t>(&map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// Streams the warp's share of the chunk through a ring of kStages stages of kStageSteps steps.
// Every warp takes an equal, contiguous share of the (tile, stage) space, at least one tile long
// (as the register kernel: at most two atomic additions onto zero per output). Lane 0 keeps the
// warp's ring full: it asks for stage j + kStages as soon as the warp has read stage j into
// registers, before decoding it. rings: the 1024-byte aligned rings; bars: the warp's kMaxStages
// mbarriers.
template <int kStageSteps, int kStages, int kBlockWarps>
__device__ __forceinline__ void StreamShare(const TmaParams& p, const Plan& plan, const unsigned char* rings,
                                            std::uint32_t bars) {
  using R = Ring<kStageSteps, kStages>;
  const Nvfp4GemvParams& g = p.g;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int grp = lane / 4, quad_lane = lane % 4;
  const unsigned char* codes = rings + warp * kStages * R::kCodeBytes;
  const unsigned char* scales = rings + R::kScalesOffset + warp * kStages * R::kScaleBytes;
  if (lane < kStages) {
    BarrierInit(bars + 8 * lane);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();  // only this warp uses its barriers

  const int stages_per_tile = g.cols / (kStageSteps * nvfp4::kStepCols);
  const int tiles_per_unit = (g.rows + kMmaRows - 1) / kMmaRows;
  const int total = plan.units * tiles_per_unit * stages_per_tile;
  const int warps = static_cast<int>(gridDim.x) * kBlockWarps;
  const int share = max((total + warps - 1) / warps, stages_per_tile);
  const int begin = (static_cast<int>(blockIdx.x) * kBlockWarps + warp) * share;
  const int n = max(0, min(begin + share, total) - begin);

  // Lane 0: stage j of the share into its ring slot.
  const auto issue = [&](int j) {
    const int stage = begin + j, slot = j % kStages, tile = stage / stages_per_tile;
    const int x0 = (stage % stages_per_tile) * kStageSteps;  // first step
    // Rows past the expert's last read the next expert's (or TMA's zeros); they are not stored.
    const int y = plan.unit[tile / tiles_per_unit].expert * g.rows + (tile % tiles_per_unit) * kMmaRows;
    const std::uint32_t bar = bars + 8 * slot;
    BarrierArriveExpect(bar, R::kCodeBytes + R::kScaleBytes);
#pragma unroll
    for (int b = 0; b < kStageSteps / 2; ++b) {
      TmaLoad(SharedAddress(codes + slot * R::kCodeBytes + b * kBoxBytes), p.codes, x0 * kStepRowBytes + b * kBoxRowBytes,
              y, bar);
    }
    TmaLoad(SharedAddress(scales + slot * R::kScaleBytes), p.scales[kStageSteps / 4], x0 * kStepScaleBytes, y, bar);
  };
  // The weights do not depend on the kernel before (it writes x and zeroes out): the first
  // stages are asked for before waiting for it.
  if (lane == 0) {
    for (int j = 0; j < min(kStages, n); ++j) issue(j);
  }
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();

  int tile = -1;
  float acc[2][4] = {};
  const __half* x = nullptr;
  const auto store = [&] {
    const Unit& unit = plan.unit[tile / tiles_per_unit];
    const int row0 = (tile % tiles_per_unit) * kMmaRows;
    const float global = __ldg(g.w.global_scales + unit.expert) * static_cast<float>(1 << nvfp4::kScaleBias);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + nvfp4::AccRow(lane, r), t = nvfp4::AccToken(lane, r);
      if (row < g.rows && t < unit.n_tok) {
        atomicAdd(g.out + unit.out[t] * g.out_stride + row, global * (acc[0][r] + acc[1][r]));
      }
    }
  };
  for (int j = 0; j < n; ++j) {
    const int stage = begin + j;
    if (stage / stages_per_tile != tile) {
      if (tile >= 0) store();
      tile = stage / stages_per_tile;
      const Unit& unit = plan.unit[tile / tiles_per_unit];
      // Column grp of the MMA is the unit's token grp; a column without a token reads the first
      // token's inputs (column n of the result depends on column n of B alone, and is not stored).
      x = g.x + static_cast<std::int64_t>(unit.vec[grp < unit.n_tok ? grp : 0]) * g.cols;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[m][r] = 0.0f;
      }
    }
    const int slot = j % kStages;
    BarrierWait(bars + 8 * slot, (j / kStages) & 1);
    StepData d[kStageSteps];
#pragma unroll
    for (int k = 0; k < kStageSteps; ++k) {
      const int chunk = ((k % 2) * (kStepRowBytes / 16) + quad_lane) ^ grp;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = grp + 8 * h;
        d[k].codes[h] = *reinterpret_cast<const uint4*>(codes + slot * R::kCodeBytes + (k / 2) * kBoxBytes +
                                                        row * kBoxRowBytes + chunk * 16);
        d[k].scales[h] = *reinterpret_cast<const unsigned short*>(scales + slot * R::kScaleBytes +
                                                                  row * R::kScaleRowBytes + k * kStepScaleBytes +
                                                                  quad_lane * 2);
      }
    }
    // Every lane has read the slot: refill it. (The proxy fence orders the warp's shared-memory
    // reads before the copy engine's writes.)
    __syncwarp();
    if (lane == 0 && j + kStages < n) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(j + kStages);
    }
    const int s0 = (stage % stages_per_tile) * kStageSteps;
#pragma unroll
    for (int k = 0; k < kStageSteps; ++k) {
      DecodeStep(d[k], reinterpret_cast<const uint4*>(x + nvfp4::LaneColumn(s0 + k, quad_lane)), acc);
    }
  }
  if (tile >= 0) store();
}

// The block's plan, then the barriers and rings in dynamic shared memory.
struct BlockSetup {
  const unsigned char* rings;
  std::uint32_t bars;  // this warp's
};

__device__ __forceinline__ BlockSetup SetUpBlock(const Nvfp4GemvParams& g, Plan& plan, int* ids) {
  extern __shared__ unsigned char smem_raw[];
  BuildPlan(g, plan, ids);
  const std::uintptr_t rings =
      (reinterpret_cast<std::uintptr_t>(smem_raw) + kBarrierBytes + kSwizzleAlign - 1) & ~std::uintptr_t{kSwizzleAlign - 1};
  const int warp = threadIdx.x / kWarpSize;
  return {reinterpret_cast<const unsigned char*>(rings), SharedAddress(smem_raw + warp * kMaxStages * 8)};
}

// The ring per chunk, from its plan: 4-step stages for chunks of at most kWideUnits distinct
// experts, 2-step stages for more.
constexpr int kWideUnits = 16;
__global__ void __launch_bounds__(kThreads, 2) Nvfp4GemvTmaAdaptiveKernel(const __grid_constant__ TmaParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ Plan plan;
  __shared__ int ids[kNvfp4MaxAssignments];
  const BlockSetup b = SetUpBlock(p.g, plan, ids);
  if (plan.units <= kWideUnits && p.g.cols % (4 * nvfp4::kStepCols) == 0) {
    StreamShare<4, 2, kWarps>(p, plan, b.rings, b.bars);
  } else {
    StreamShare<2, 3, kWarps>(p, plan, b.rings, b.bars);
  }
#endif
}

using EncodeTiledFn = PFN_cuTensorMapEncodeTiled_v12000;

// The driver's tensor-map encoder, through the runtime (no link against libcuda).
absl::StatusOr<EncodeTiledFn> EncodeTiled() {
  static const absl::StatusOr<EncodeTiledFn> fn = []() -> absl::StatusOr<EncodeTiledFn> {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    RETURN_IF_ERROR(CudaStatus(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                                                &found),
                               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)"));
    if (found != cudaDriverEntryPointSuccess || f == nullptr) {
      return absl::FailedPreconditionError("the CUDA driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// A 2-D byte tensor [rows][row_bytes] read in boxes of 16 rows x box_bytes.
absl::StatusOr<CUtensorMap> ByteTensorMap(const void* base, std::int64_t rows, std::int64_t row_bytes, int box_bytes,
                                          CUtensorMapSwizzle swizzle) {
  ASSIGN_OR_RETURN(const EncodeTiledFn encode, EncodeTiled());
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_bytes), static_cast<cuuint32_t>(kMmaRows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuTensorMapEncodeTiled: error ", static_cast<int>(r), " for ", rows,
                                            " x ", row_bytes, " bytes, boxes of ", box_bytes));
  }
  return map;
}

bool DeviceHasTma() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

template <typename Kernel>
absl::Status Launch(Kernel kernel, int ring_bytes, const TmaParams& p, const LaunchContext& ctx) {
  const std::size_t smem = SmemBytes(ring_bytes);
  RETURN_IF_ERROR(CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                             "cudaFuncSetAttribute(Nvfp4GemvTmaKernel shared memory)"));
  const dim3 grid(static_cast<unsigned>(ctx.num_sms * 2));  // two blocks an SM (__launch_bounds__)
  RETURN_IF_ERROR(LaunchProgrammaticDependent(kernel, grid, dim3(kThreads), smem, ctx, p));
  return CheckLaunch("Nvfp4GemvTmaKernel");
}

}  // namespace

bool Nvfp4GemvTmaApplies(const Nvfp4GemvParams& g) {
  static const bool has_tma = DeviceHasTma();
  const auto aligned = [](const void* q) { return reinterpret_cast<std::uintptr_t>(q) % 16 == 0; };
  return has_tma && g.rows > 0 && g.cols > 0 && g.cols % (2 * nvfp4::kStepCols) == 0 && aligned(g.w.packed) &&
         aligned(g.w.scales) && static_cast<std::int64_t>(g.num_experts) * g.rows < (std::int64_t{1} << 31);
}

absl::Status LaunchNvfp4GemvTma(const Nvfp4GemvParams& g, const LaunchContext& ctx) {
  if (!Nvfp4GemvTmaApplies(g)) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4GemvTma: ", g.rows, " x ", g.cols,
                                                   " rows x cols (or unaligned weights) not taken"));
  }
  const std::int64_t rows = static_cast<std::int64_t>(g.num_experts) * g.rows;
  TmaParams p;
  p.g = g;
  ASSIGN_OR_RETURN(p.codes, ByteTensorMap(g.w.packed, rows, g.cols / 2, kBoxRowBytes, CU_TENSOR_MAP_SWIZZLE_128B));
  for (int wide = 0; wide < 2; ++wide) {
    if (wide == 1 && g.cols % (4 * nvfp4::kStepCols) != 0) break;
    ASSIGN_OR_RETURN(p.scales[wide], ByteTensorMap(g.w.scales, rows, g.cols / kNvfp4BlockSize,
                                                   (2 + 2 * wide) * kStepScaleBytes, CU_TENSOR_MAP_SWIZZLE_NONE));
  }
  return Launch(Nvfp4GemvTmaAdaptiveKernel, std::max(Ring<4, 2>::kBytes, Ring<2, 3>::kBytes), p, ctx);
}

}  // namespace nq::kernels::cuda
