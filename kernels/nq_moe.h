// The NestQuant routed-expert block (issue #12; DESIGN.md sections 3 and 6): every routed expert
// of a layer held only as the release's packed codes, dequantised inside the GEMV.
//
// For each token t and each of its top-k assignments (expert e, weight w):
//   xr  = R_in x[t]                          input rotation, once per token and layer
//   g   = R_g^T (diag(rs) Q_gate diag(cs)) xr  gate rows (Q from the codes, see below)
//   u   = R_g^T (diag(rs) Q_up   diag(cs)) xr  up rows
//   h   = R_dc (silu(g) * u)                  into the down projection's rotated domain
//   y' += w * diag(rs) Q_down diag(cs) h
//   out[t] = R_dr^T y'                         output rotation, once per token and layer
// which is sum_k w_k * expert_k(x[t]) with each expert's dense weights W = R_rows^T W' R_cols
// (services/quant/hadamard.h; W' = diag(rs) Q diag(cs) is what both codecs code).
// The shared expert is not part of this op (callers add it); the benchmark passes it as one more
// expert with weight 1.
//
// Codes: each projection of each expert has a 2-bit base plane and, at 4 bits, a 2-bit residual
// plane of the same size (rows * cols / 4 bytes). What Q is depends on the layer's codec:
//   nested_scalar_v1  planes in codec.h's PackCodes layout (row-major, 4 codes per byte, code k
//                     at bits 2*(k%4)). Q[i][j] = levels[b] at 2 bits and levels[4 + 4b + r] at
//                     4 bits, where r is the code from the residual plane.
//   trellis_v1        planes in tile order (services/quant/trellis_decode.h: 64 bytes per 16 x 16
//                     tile, tiles row-major over the tile grid). With U the computed codebook
//                     and sb, sr the base and residual states of weight (i, j):
//                     Q[i][j] = gb[j/16] * U(sb) at 2 bits, + gr[j/16] * U(sr) at 4 bits, the
//                     gains being the expert's per-16-column-block base and residual gains.
//                     The CUDA backend runs it on the prefill path (>= 16 tokens, hidden and
//                     intermediate multiples of 64) and answers Unimplemented elsewhere until
//                     the decode GEMV decodes tiles (kernels/cuda/trellis_tile.cuh).
// Low-rank corrections (issue #16; services/quant/low_rank.h), where a layer has them
// (NqMoeWeights::lowrank_rank = R > 0): a projection may add, in the rotated domain where its GEMV
// runs, U_b (V_b v) at both precisions and U_r (V_r v) at 4 bits, v being the GEMV's rotated input:
//   y' = diag(rs) Q diag(cs) v + U_b V_b v [+ U_r V_r v]
// U_b [rows, R] and V_b [R, cols] are resident F32 (zero past an expert's own rank, all zero for an
// expert without); U_r, V_r are read from the slot at the projection's lowrank_offset as fp16,
// U_r [rows, R] then V_r [R, cols] (quant::PackLowRank). Backends that do not apply them say so
// (Backend::AppliesNqLowRank) and refuse such a layer.
// An expert runs at 4 bits exactly when slot_of_expert[e] names a slot (0 <= s < num_slots); its
// residual planes are read in place from that slot of the arena, at each projection's
// residual_offset. That choice is made per expert where the op runs (on the device for CUDA):
// the host never waits on it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/nq_moe_params.h"
#include "kernels/tensor.h"

namespace nq::kernels {

// The level table of one matrix: kNqBaseLevels base levels c_b, then the kNqLevels4 4-bit levels
// c_b + d_{b,r} at index 4b + r (computed in float as the CPU decoder does). The CPU op uses them
// as they are; the CUDA kernels hold them as fp16, which is exact for the levels nq encode writes
// (quant::SnapToHalfGrid) and rounds others (2^-11 relative, a bias that does not average out).
inline constexpr int kNqBaseLevels = 4;
inline constexpr int kNqLevels4 = 16;
inline constexpr int kNqLevelTable = kNqBaseLevels + kNqLevels4;
// The largest low-rank correction rank (quant::kMaxLowRank).
inline constexpr int kNqMaxLowRank = 4;

// trellis_v1 keeps one (base gain, residual gain) pair per 16-column block of each matrix
// (CodecParams::base_codebook[tj], residual_codebook[tj]); the pair is stored together so one
// 8-byte load serves both planes.
inline constexpr int kNqTrellisBlock = 16;
inline constexpr int kNqGainsPerBlock = 2;

// One projection (gate_proj, up_proj or down_proj) of every routed expert of a layer. Exactly
// one of levels and gains is set, as the layer's codec says; the other stays an empty Tensor.
struct NqProjection {
  Tensor base;        // U8 [E, rows * cols / 4]
  Tensor row_scales;  // F32 [E, rows]
  Tensor col_scales;  // F32 [E, cols]
  Tensor levels;      // nested_scalar_v1: F32 [E, kNqLevelTable]
  Tensor gains;       // trellis_v1: F32 [E, cols / 16, 2]: (base, residual) gain of block tj
  // Byte offset of this projection's residual plane (rows * cols / 4 bytes) inside a slot.
  std::int64_t residual_offset = 0;
  // Low-rank corrections (above), set exactly when some expert of the layer corrects this
  // projection: F32 [E, rows, R] and [E, R, cols], and the byte offset of the fp16 residual-level
  // factors inside a slot (NqLowRankBytes bytes); otherwise empty tensors and -1.
  Tensor lowrank_u;
  Tensor lowrank_v;
  std::int64_t lowrank_offset = -1;
};

// A random-sign Hadamard rotation: x -> blockdiag(H_block) diag(signs) x (hadamard.h).
struct NqRotation {
  Tensor signs;  // F32 [n], each +1 or -1
  std::int64_t block = 0;
};

// A layer's routed experts: E experts, hidden size D, intermediate size I (this rank's slice).
// gate/up are [I, D], down is [D, I].
// trellis_v1 needs hidden and intermediate multiples of 16 (whole tiles).
struct NqMoeWeights {
  NqCodec codec = NqCodec::kNestedScalar;
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  std::int64_t num_experts = 0;
  std::int64_t lowrank_rank = 0;  // R: the layer's low-rank max rank, 0 without corrections
  NqProjection gate;
  NqProjection up;
  NqProjection down;
  NqRotation input;      // columns of gate/up (width D)
  NqRotation gate_rows;  // rows of gate/up (width I)
  NqRotation down_cols;  // columns of down (width I)
  NqRotation down_rows;  // rows of down (width D)
};

// Where residual planes live: the layer's slot table and the slot arena it points into. The
// arena is memory of the backend's kind (device memory for CUDA: the worker's DeviceArena;
// host memory for CPU), owned by whoever registered it, num_slots * slot_bytes long.
struct NqSlots {
  // I32 [E], or [R, E] with slot_table_row naming this layer's row (a slot mailbox's table of
  // every layer, Model::SetSlotMailbox); -1 (or any value outside the arena) = 2 bits.
  const Tensor* slot_of_expert = nullptr;
  std::int64_t slot_table_row = 0;
  const std::byte* arena = nullptr;
  std::int64_t slot_bytes = 0;
  std::int64_t num_slots = 0;
  // Slots scattered over memory (a layer-major prefill's slots in room the free KV cache lends,
  // issue #23): U8 [num_slots * 8] holding each slot's record address, a pointer of this
  // backend's memory (the tensor types have no 64-bit integer), or null: slot s is arena + s *
  // slot_bytes. arena must still be set (any slot's record) to say there are slots.
  const Tensor* slot_records = nullptr;
};

// Bytes of a projection's fp16 residual-level factors at rank R (quant::LowRankBytes).
inline std::int64_t NqLowRankBytes(std::int64_t rows, std::int64_t cols, std::int64_t rank) {
  return (rows + cols) * rank * 2;
}

// Bytes of a packed 2-bit plane of rows x cols codes.
inline std::int64_t NqPlaneBytes(std::int64_t rows, std::int64_t cols) { return (rows * cols + 3) / 4; }

}  // namespace nq::kernels
