// The NestQuant MoE op's arguments as raw pointers, after Backend::NqMoe has validated them
// (kernels/nq_moe.h states the math). Shared by the CPU reference and the CUDA kernels, so it
// includes nothing but <cstdint>. Pointers are memory of the backend that runs the op.
#pragma once

#include <cstdint>

namespace nq::kernels {

// Which codec a layer's planes are coded with (the release manifest's codec name; the math of
// each: kernels/nq_moe.h).
enum class NqCodec : std::int32_t {
  kNestedScalar = 0,  // nested_scalar_v1: level tables
  kTrellis = 1,       // trellis_v1: tile-ordered planes, computed codebook, per-block gains
};

struct NqProjectionView {
  const std::uint8_t* base = nullptr;  // [E][rows * cols / 4] packed 2-bit codes
  const float* row_scales = nullptr;   // [E][rows]
  const float* col_scales = nullptr;   // [E][cols]
  const float* levels = nullptr;       // nested scalar: [E][kNqLevelTable]; else null
  const float* gains = nullptr;        // trellis: [E][cols / 16][2] (base, residual); else null
  std::int64_t residual_offset = 0;    // inside a slot
  const float* lowrank_u = nullptr;    // [E][rows][R] or null (no correction in this projection)
  const float* lowrank_v = nullptr;    // [E][R][cols] or null
  std::int64_t lowrank_offset = -1;    // fp16 residual-level factors inside a slot, or -1
};

struct NqRotationView {
  const float* signs = nullptr;  // [n]
  std::int64_t block = 0;        // power of two dividing n
};

struct NqMoeParams {
  NqCodec codec = NqCodec::kNestedScalar;
  std::int64_t tokens = 0;        // T
  std::int64_t top_k = 0;         // K assignments per token
  std::int64_t hidden = 0;        // D
  std::int64_t intermediate = 0;  // I
  std::int64_t num_experts = 0;   // E
  std::int64_t lowrank_rank = 0;  // R, 0 without low-rank corrections
  const float* x = nullptr;                  // [T, D]
  const std::int32_t* expert_ids = nullptr;  // [T, K]; distinct within a token
  const float* expert_weights = nullptr;     // [T, K]
  float* out = nullptr;                      // [T, D]; must not alias x
  NqProjectionView gate, up, down;
  NqRotationView input, gate_rows, down_cols, down_rows;
  const std::int32_t* slot_of_expert = nullptr;  // [E]
  // The slots' records: num_slots * slot_bytes from arena, or, where slot_records is set, one
  // record of slot_bytes at each of its num_slots addresses (slots scattered over memory lent by
  // the free KV cache, issue #23). arena is non-null whenever there are slots.
  const std::uint8_t* arena = nullptr;
  const std::uint8_t* const* slot_records = nullptr;
  std::int64_t slot_bytes = 0;
  std::int64_t num_slots = 0;
};

#if defined(__CUDACC__)
#define NQ_PARAMS_INLINE __host__ __device__ __forceinline__
#else
#define NQ_PARAMS_INLINE inline
#endif

// Where slot `slot`'s record starts (0 <= slot < num_slots).
NQ_PARAMS_INLINE const std::uint8_t* NqSlotRecord(const NqMoeParams& p, std::int64_t slot) {
  return p.slot_records != nullptr ? p.slot_records[slot] : p.arena + slot * p.slot_bytes;
}

// The residual plane of `projection` for expert e, or null when e runs at 2 bits.
NQ_PARAMS_INLINE const std::uint8_t* NqResidualPlane(const NqMoeParams& p, const NqProjectionView& projection,
                                                     std::int32_t slot) {
  if (p.arena == nullptr || slot < 0 || slot >= p.num_slots) return nullptr;
  return NqSlotRecord(p, slot) + projection.residual_offset;
}

// Tokens [t0, t0 + n) of p as an op of their own (the CUDA paths run long inputs chunk by chunk).
inline NqMoeParams NqMoeTokenChunk(const NqMoeParams& p, std::int64_t t0, std::int64_t n) {
  NqMoeParams chunk = p;
  chunk.tokens = n;
  chunk.x = p.x + t0 * p.hidden;
  chunk.out = p.out + t0 * p.hidden;
  chunk.expert_ids = p.expert_ids + t0 * p.top_k;
  chunk.expert_weights = p.expert_weights + t0 * p.top_k;
  return chunk;
}

}  // namespace nq::kernels
