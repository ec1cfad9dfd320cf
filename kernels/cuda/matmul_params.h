// Arguments of the MatMul kernels (matmul.cuh, matmul_gemv.cuh), filled by CudaBackend after
// Backend has validated shapes and dtypes.
#pragma once

#include <cstdint>

#include "kernels/decode_gemv.h"
#include "kernels/dtype.h"

namespace nq::kernels::cuda {

// One more matrix over the same x, k and weight dtype (Backend::MatMulSharedInput): y_e[m, n_e]
// = x · w_e^T, computed in the same launch as the first.
struct MatMulExtra {
  const void* w = nullptr;          // [n, k], elements of MatMulParams::w_dtype
  const float* w_scale = nullptr;   // F8E4M3 only, as MatMulParams::w_scale
  float* y = nullptr;               // [m, n]
  int n = 0;
};
inline constexpr int kMatMulMaxExtra = 7;

struct MatMulParams {
  const float* x = nullptr;  // [m, k], row-major
  const void* w = nullptr;   // [n, k], row-major, elements of w_dtype
  DType w_dtype = DType::kF32;
  // F8E4M3 weights only (else null): F32 [ceil(n / 128), ceil(k / 128)], row-major;
  // w[j, p] = float(w[j, p]) * w_scale[j / 128, p / 128] (kWeightScaleBlock).
  const float* w_scale = nullptr;
  float* y = nullptr;  // [m, n], row-major; overlaps neither x nor w
  int m = 0;
  int n = 0;
  int k = 0;
  // The GEMV's split of k (m <= kGemvMaxRows): 0 lets GemvSplits choose; benchmarks force a
  // count (clamped to [1, kGemvMaxSplits] and to the column steps).
  int k_splits = 0;
  // Which GEMV kernel (m <= kGemvMaxRows) runs BF16 weights: kAuto lets the launcher choose by
  // the matrix (MmaGemvPays); benchmarks force one to measure it against the other (a matrix the
  // tensor cores cannot read takes the FMA kernel regardless).
  DecodeGemv gemv_kernel = DecodeGemv::kAuto;  // BackendOptions::cuda_decode_gemv
  // Further matrices the GEMV computes in the same launch, their 32-row blocks after w's (the
  // tiled path runs them one by one). Each n > 0.
  MatMulExtra extra[kMatMulMaxExtra] = {};
  int num_extra = 0;
  // Set by the GEMV launcher, not by callers: the grid is resident at once (GemvGridFitsOneWave),
  // so its blocks let the next kernel launch right after their own wait instead of after their
  // main loop (matmul_gemv.cuh).
  bool early_dependents = false;
};

// How many column ranges (gridDim.y, one thread-block cluster per 32 rows; matmul_gemv.cuh) the
// GEMV (matmul.cu) splits k into for a launch of row_blocks 32-row blocks and col_steps warp steps of
// columns, on num_sms multiprocessors: 1 when the rows give every SM a block, else enough to,
// up to kGemvMaxSplits. Depends on the matrix only, never on m,
// so a row's sum is added in the same order for 1 token and for 8 (batch invariance).
int GemvSplits(int row_blocks, int col_steps, int num_sms);

// Whether the tensor-core GEMV (matmul_gemv_mma.cuh) pays for a BF16 matrix of row_blocks 32-row
// blocks (all of a MatMulSharedInput group's). Measured on an H100 (bench/README.md, gemv_bench): at every shape
// whose blocks fill the SMs unsplit they equal the FMA kernel at one token (0.99-1.04x) and beat it
// from four (1.04-1.22x at 4, 1.14-1.55x at 8); with fewer blocks than SMs (k split over a
// cluster, latency-bound: q_a, kv_a, k_pe, the indexer's, q_pe) they lose 8-27 % at one token
// and tie at four. Depends on the matrix and the device only, never on m (batch invariance).
inline bool MmaGemvPays(std::int64_t row_blocks, int num_sms) { return row_blocks >= num_sms; }

// Whether a GEMV grid of `blocks` blocks is resident at once: both GEMV kernels fit
// kGemvMinBlocksPerSm (2) blocks an SM (their launch bounds). Such a grid's blocks let their
// programmatic dependent launch as soon as they have waited for their own prerequisite: the
// dependent's blocks then take the SMs' free slots and finish their launch while the GEMV streams,
// instead of launching only once its last block leaves the main loop. A grid of more waves keeps
// the signal after its loop, so a later wave's blocks never compete for slots with the dependent.
inline bool GemvGridFitsOneWave(std::int64_t blocks, int num_sms) { return blocks <= 2 * std::int64_t{num_sms}; }

}  // namespace nq::kernels::cuda
