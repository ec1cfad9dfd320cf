// The NVFP4 MoE op's arguments as raw pointers, after Backend::Nvfp4Moe has validated them
// (kernels/nvfp4_moe.h states the math). Shared by the CPU reference and the CUDA kernels, so it
// includes nothing but <cstdint>. Pointers are memory of the backend that runs the op.
#pragma once

#include <cstdint>

namespace nq::kernels {

struct Nvfp4ProjectionView {
  const std::uint8_t* packed = nullptr;  // [E][rows][cols / 2]
  const std::uint8_t* scales = nullptr;  // [E][rows][cols / 16] E4M3 codes
  const float* global_scales = nullptr;  // [E]
};

struct Nvfp4MoeParams {
  std::int64_t tokens = 0;        // T
  std::int64_t top_k = 0;         // K assignments per token
  std::int64_t hidden = 0;        // D
  std::int64_t intermediate = 0;  // I
  std::int64_t num_experts = 0;   // E
  const float* x = nullptr;                  // [T, D]
  const std::int32_t* expert_ids = nullptr;  // [T, K]; distinct within a token
  const float* expert_weights = nullptr;     // [T, K]
  float* out = nullptr;                      // [T, D]; must not alias x
  Nvfp4ProjectionView gate_up;               // rows 2I, cols D
  Nvfp4ProjectionView down;                  // rows D, cols I
};

// Tokens [t0, t0 + n) of p as an op of their own (the CUDA path runs long inputs chunk by chunk).
inline Nvfp4MoeParams Nvfp4MoeTokenChunk(const Nvfp4MoeParams& p, std::int64_t t0, std::int64_t n) {
  Nvfp4MoeParams chunk = p;
  chunk.tokens = n;
  chunk.x = p.x + t0 * p.hidden;
  chunk.out = p.out + t0 * p.hidden;
  chunk.expert_ids = p.expert_ids + t0 * p.top_k;
  chunk.expert_weights = p.expert_weights + t0 * p.top_k;
  return chunk;
}

}  // namespace nq::kernels
