#include "kernels/cuda/nvfp4_gemv.cuh"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"
#include "services/common/status_macros.h"
#include "kernels/nvfp4_codes.h"

namespace nq::kernels::cuda {
namespace {

constexpr int kMmaRows = 16;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kBlocksPerSm = 2;
constexpr int kStepCols = 4 * kNvfp4LaneCols;  // 128 columns per warp step (a quad's 64 bytes)
// Steps whose code loads a warp issues before decoding the first of them: 4 KB in flight per
// warp, 64 KB per SM at two blocks of eight warps, about what the H200's bandwidth-latency
// product asks of each SM.
constexpr int kDepth = 4;

// E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as the high byte of their fp16 encoding (the low
// byte is 0 for all eight): the byte tables PTX prmt indexes with a 3-bit magnitude code.
constexpr std::uint32_t kE2M1HighBytesLo = 0x3E3C3800u;  // codes 0..3
constexpr std::uint32_t kE2M1HighBytesHi = 0x46444240u;  // codes 4..7
// prmt selectors spreading bytes 0, 1 (or 2, 3) of a register into the high bytes of a half2,
// zeros (byte 4: the zero operand) in the low bytes.
constexpr std::uint32_t kSpread01 = 0x1404u;
constexpr std::uint32_t kSpread23 = 0x3424u;

// The chunk's distinct experts (units), worked out once per block in shared memory.
struct Unit {
  int expert;
  int n_tok;                             // columns used: tokens routing to the expert
  int vec[kNvfp4MaxDecodeTokens];        // input vector of each column
  int out[kNvfp4MaxDecodeTokens];        // output row (assignment) of each column
};

struct Plan {
  int units;
  int warp_units[kNvfp4MaxAssignments / kWarpSize];
  Unit unit[kNvfp4MaxAssignments];
};

__device__ __forceinline__ std::uint32_t Prmt(std::uint32_t a, std::uint32_t b, std::uint32_t s) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}

// Eight E2M1 codes (element 2i in the low nibble of byte i) -> four half2 (elements 2i, 2i + 1).
// Magnitudes come from the byte table; signs from prmt's sign-replicate mode: a selector nibble
// with bit 3 set yields the replicated top bit of a 0x7F byte, i.e. 0x00 for a negative code
// and 0x7F for a positive one, whose complement's top bit is the fp16 sign.
__device__ __forceinline__ void DecodeE2M1Word(std::uint32_t w, __half2 (&h)[4]) {
  const std::uint32_t m = w & 0x77777777u;
  const std::uint32_t mag_lo = Prmt(kE2M1HighBytesLo, kE2M1HighBytesHi, m);
  const std::uint32_t mag_hi = Prmt(kE2M1HighBytesLo, kE2M1HighBytesHi, m >> 16);
  const std::uint32_t pos_lo = Prmt(0x7F7F7F7Fu, 0x7F7F7F7Fu, w);
  const std::uint32_t pos_hi = Prmt(0x7F7F7F7Fu, 0x7F7F7F7Fu, w >> 16);
  const std::uint32_t b_lo = mag_lo | (~pos_lo & 0x80808080u);
  const std::uint32_t b_hi = mag_hi | (~pos_hi & 0x80808080u);
  const std::uint32_t r[4] = {Prmt(b_lo, 0u, kSpread01), Prmt(b_lo, 0u, kSpread23), Prmt(b_hi, 0u, kSpread01),
                              Prmt(b_hi, 0u, kSpread23)};
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = *reinterpret_cast<const __half2*>(&r[i]);
}

// Two E4M3 codes (low byte: the first block) -> half2, exactly (every E4M3 value, NaN included,
// is an fp16 value).
__device__ __forceinline__ __half2 DecodeE4M3Pair(std::uint16_t codes) {
  std::uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(codes));
  return *reinterpret_cast<const __half2*>(&r);
}

// 16 bytes of codes, read once: not kept in L1 (no other warp reads them).
__device__ __forceinline__ uint4 LoadStreaming(const std::uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void Mma16816(float (&d)[4], const __half2& a0, const __half2& a1, const __half2& a2,
                                         const __half2& a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(*reinterpret_cast<const std::uint32_t*>(&a0)), "r"(*reinterpret_cast<const std::uint32_t*>(&a1)),
        "r"(*reinterpret_cast<const std::uint32_t*>(&a2)), "r"(*reinterpret_cast<const std::uint32_t*>(&a3)),
        "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t Word(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// Unit u is the u-th assignment (in order) whose expert no earlier assignment names; its columns
// are the assignments of that expert from there on. Every thread of the block calls this (it
// ends on a barrier); one thread per assignment (assignments <= kThreads).
__device__ __forceinline__ void BuildPlan(const Nvfp4GemvParams& g, Plan& plan, int* ids) {
  const int A = g.assignments, a = threadIdx.x, lane = a % kWarpSize, warp = a / kWarpSize;
  if (a < A) ids[a] = g.expert_ids[a];
  __syncthreads();
  const int e = a < A ? ids[a] : -1;
  bool first = e >= 0 && e < g.num_experts;
  for (int b = 0; b < a && first; ++b) first = ids[b] != e;
  const unsigned mask = warp < kNvfp4MaxAssignments / kWarpSize ? __ballot_sync(0xffffffffu, first) : 0u;
  if (lane == 0 && warp < kNvfp4MaxAssignments / kWarpSize) plan.warp_units[warp] = __popc(mask);
  __syncthreads();
  if (first) {
    int u = __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) u += plan.warp_units[w];
    Unit& unit = plan.unit[u];
    unit.expert = e;
    int n = 0;
    for (int b = a; b < A && n < kNvfp4MaxDecodeTokens; ++b) {
      if (ids[b] != e) continue;
      unit.vec[n] = g.x_per_token ? b / g.top_k : b;
      unit.out[n] = b;
      ++n;
    }
    unit.n_tok = n;
  }
  if (threadIdx.x == 0) {
    int units = 0;
    for (int w = 0; w < kNvfp4MaxAssignments / kWarpSize; ++w) units += plan.warp_units[w];
    plan.units = units;
  }
  __syncthreads();
}

// One warp step's loads: 16 code bytes of rows g and g + 8 and their two block scales each.
struct StepData {
  uint4 codes[2];
  std::uint16_t scales[2];
};

// Every warp of the grid takes an equal, contiguous share of the (tile, step) space (tiles ordered
// unit, 16-row tile); a share is at least one tile long, so each tile is split between at most two
// warps and each output gets at most two atomic additions onto zero (commutative in fp32: the
// result does not depend on timing).
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) Nvfp4GemvKernel(const __grid_constant__ Nvfp4GemvParams g) {
  __shared__ Plan plan;
  __shared__ int ids[kNvfp4MaxAssignments];
  BuildPlan(g, plan, ids);
  // The inputs and the zeroed outputs come from the kernel before: wait for it, then let the
  // next kernel launch (it waits for all of this one before reading).
  WaitForPrerequisiteGrid();
  LetDependentsLaunch();

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int grp = lane / 4, quad_lane = lane % 4;
  const int steps = (g.cols + kStepCols - 1) / kStepCols;
  const int tiles_per_unit = (g.rows + kMmaRows - 1) / kMmaRows;
  const int total = plan.units * tiles_per_unit * steps;
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int share = max((total + warps - 1) / warps, steps);
  int idx = (static_cast<int>(blockIdx.x) * kWarps + warp) * share;
  const int end = min(idx + share, total);
  const std::int64_t row_bytes = g.cols / 2, row_scales = g.cols / kNvfp4BlockSize;

  while (idx < end) {
    const int tile = idx / steps, s0 = idx % steps, s1 = min(steps, s0 + (end - idx));
    idx += s1 - s0;
    const Unit& unit = plan.unit[tile / tiles_per_unit];
    const int row0 = (tile % tiles_per_unit) * kMmaRows;
    const std::int64_t e = unit.expert;
    // Rows g and g + 8; tail rows re-read the last row (their results are not stored).
    const std::uint8_t* codes[2];
    const std::uint8_t* scales[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t row = e * g.rows + min(row0 + grp + 8 * h, g.rows - 1);
      codes[h] = g.w.packed + row * row_bytes;
      scales[h] = g.w.scales + row * row_scales;
    }
    // Column grp of the MMA is the unit's token grp; a column without a token reads the first
    // token's inputs (column n of the result depends on column n of B alone, and is not stored).
    const __half* x = g.x + static_cast<std::int64_t>(unit.vec[grp < unit.n_tok ? grp : 0]) * g.cols;
    float acc[2][4] = {};
    for (int s = s0; s < s1; s += kDepth) {
      StepData d[kDepth];
#pragma unroll
      for (int k = 0; k < kDepth; ++k) {
        const int c0 = (s + k) * kStepCols + quad_lane * kNvfp4LaneCols;
        const bool valid = s + k < s1 && c0 < g.cols;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          d[k].codes[h] = valid ? LoadStreaming(codes[h] + c0 / 2) : make_uint4(0, 0, 0, 0);
          d[k].scales[h] =
              valid ? __ldg(reinterpret_cast<const unsigned short*>(scales[h] + c0 / kNvfp4BlockSize)) : 0;
        }
      }
#pragma unroll
      for (int k = 0; k < kDepth; ++k) {
        const int c0 = (s + k) * kStepCols + quad_lane * kNvfp4LaneCols;
        if (s + k >= s1) break;
        // A lane past the row's end decodes zeros and must not read inputs (a zero weight times
        // a NaN beyond the vector would poison its column).
        const bool valid = c0 < g.cols;
        const __half2 sc[2] = {DecodeE4M3Pair(d[k].scales[0]), DecodeE4M3Pair(d[k].scales[1])};
        const uint4* xv = reinterpret_cast<const uint4*>(x + c0);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          // Words 0, 1 hold the lane's first block, words 2, 3 its second.
          __half2 a[2][4];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            DecodeE2M1Word(Word(d[k].codes[h], q), a[h]);
            const __half2 scale = q < 2 ? __low2half2(sc[h]) : __high2half2(sc[h]);
#pragma unroll
            for (int i = 0; i < 4; ++i) a[h][i] = __hmul2(a[h][i], scale);
          }
          const uint4 b = valid ? __ldg(xv + q) : make_uint4(0, 0, 0, 0);
          Mma16816(acc[0], a[0][0], a[1][0], a[0][1], a[1][1], b.x, b.y);
          Mma16816(acc[1], a[0][2], a[1][2], a[0][3], a[1][3], b.z, b.w);
        }
      }
    }
    // C holds (row g, tokens 2j, 2j + 1) and (row g + 8, tokens 2j, 2j + 1).
    const float global = __ldg(g.w.global_scales + e);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + grp + 8 * h;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int t = 2 * quad_lane + n;
        if (row < g.rows && t < unit.n_tok) {
          atomicAdd(g.out + unit.out[t] * g.out_stride + row, global * (acc[0][2 * h + n] + acc[1][2 * h + n]));
        }
      }
    }
  }
}

}  // namespace

absl::Status LaunchNvfp4Gemv(const Nvfp4GemvParams& g, const LaunchContext& ctx) {
  if (g.assignments <= 0 || g.assignments > kNvfp4MaxAssignments || g.top_k <= 0 ||
      g.assignments > kNvfp4MaxDecodeTokens * g.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Gemv: ", g.assignments, " assignments of top_k ", g.top_k,
                                                   "; a chunk takes at most ", kNvfp4MaxAssignments));
  }
  if (g.rows <= 0 || g.cols <= 0 || g.cols % kNvfp4LaneCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Gemv: ", g.rows, " x ", g.cols, " rows x cols; cols must be a ",
                                                   "positive multiple of ", kNvfp4LaneCols));
  }
  static_assert(kNvfp4MaxAssignments <= kThreads, "BuildPlan takes one thread per assignment");
  // Programmatic dependent launch: the plan is built while the kernel before finishes.
  RETURN_IF_ERROR(LaunchProgrammaticDependent(Nvfp4GemvKernel, dim3(static_cast<unsigned>(ctx.num_sms * kBlocksPerSm)),
                                              dim3(kThreads), 0, ctx, g));
  return CheckLaunch("Nvfp4GemvKernel");
}

}  // namespace nq::kernels::cuda
