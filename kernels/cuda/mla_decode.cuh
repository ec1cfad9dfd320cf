// MLA attention for a few queries (decode, MTP verification): every head of a query shares each
// pass over the latent cache, and the keys are split across blocks so one query fills the GPU.
// Same contract as MlaAttention (kernels/backend.h); four kernels:
//
//  1. MlaAbsorbKernel: q_lat = q_nope · w_uk[h] for every head, joined with q_pe and the softmax
//     scale, written as the attention kernel's tensor-core A operand: 16-head groups of
//     [16 x (c + dr)] in bf16, each value as hi + lo (two bf16 whose sum carries ~16 bits).
//  2. MlaSplitKernel: block (split, head group, query) streams its share of the query's keys in
//     32-key tiles (cp.async, double-buffered) and runs them on mma.sync m16n8k16: scores
//     S = Q · K^T, an online softmax per head, O += P · V, with K = [latent, k_pe] and V = latent
//     (the same rows: each key is read from memory once for every head). fp32 operands are split
//     into bf16 hi + lo and multiplied as hi·hi + hi·lo + lo·hi (the "bf16x3" scheme): the error
//     is ~2^-16 of each product, so results keep fp32-class accuracy while the latent is fp32.
//     Packed FP8 rows (kernels/kv_fp8.h) are copied as stored and unpacked per tile into bf16
//     codes (exact) and their scales, which multiply each 128-wide slice of a score and P before
//     it meets V's slice: two MMAs per product, as for a BF16 cache. Each split writes its unnormalised O, running max and sum for its 16 heads.
//  3. MlaCombineKernel: per (query, head, 64 or 128 latent columns) rescales and sums the splits'
//     partial O (flash-decoding's merge).
//  4. MlaOutputKernel: out = w_uv[h] · O, each w_uv row read once for every query.
//
// No host synchronisation; the scratch is the caller's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/mla_attention.cuh"

namespace nq::kernels::cuda {

inline constexpr int kMlaDecodeMaxTokens = 64;
inline constexpr int kMlaHeadGroup = 16;  // the MMA's M
inline constexpr int kMlaMaxLatent = 512;  // c: the PV accumulators of a warp (c / 64 MMA tiles)
inline constexpr int kMlaMaxSplits = 256;  // the merge reads one split per thread

// Whether the split kernels take these shapes; MlaAttention uses them when they do.
bool MlaDecodeApplies(const MlaAttentionParams& p);

// How the launch divides the work; the scratch it needs follows from it.
struct MlaDecodePlan {
  int head_groups = 0;
  int splits = 0;
  std::size_t q_bytes = 0;        // the absorbed queries, bf16 hi + lo
  std::size_t partial_bytes = 0;  // each split's O [16 x c] fp32
  std::size_t stats_bytes = 0;    // each split's running max and sum per head
  std::size_t o_bytes = 0;        // the merged latent output [tokens, heads, c] fp32
  std::size_t ScratchBytes() const { return q_bytes + partial_bytes + 2 * stats_bytes + o_bytes; }
};
// `splits` > 0 overrides the automatic split count (clamped to [1, kMlaMaxSplits]; benchmarks).
MlaDecodePlan PlanMlaDecode(const MlaAttentionParams& p, int num_sms, int splits = 0);

// `scratch`: device memory of plan.ScratchBytes(), 16-byte aligned. InvalidArgumentError unless
// MlaDecodeApplies(p) and the scratch is large enough.
absl::Status LaunchMlaDecode(const MlaAttentionParams& p, const MlaDecodePlan& plan,
                             void* scratch, std::size_t scratch_bytes, const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
