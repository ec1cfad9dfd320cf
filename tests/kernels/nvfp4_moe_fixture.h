// Random NVFP4 MoE layers for the Nvfp4Moe op's tests (CPU and CUDA): packed E2M1 codes, E4M3
// block scales and per-expert global scales in ModelOpt's layout, uploaded to any backend; and a
// double-precision dense reference of the op from the decoded weights.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/backend.h"

namespace nq::kernels::testing {

struct Nvfp4ProjectionHost {
  std::int64_t rows = 0, cols = 0;
  std::vector<std::uint8_t> packed;  // [E][rows][cols / 2]
  std::vector<std::uint8_t> scales;  // [E][rows][cols / 16]
  std::vector<float> global;         // [E]
};

struct Nvfp4MoeHost {
  std::int64_t hidden = 0, intermediate = 0, num_experts = 0;
  Nvfp4ProjectionHost gate_up;  // [2I, D]
  Nvfp4ProjectionHost down;     // [D, I]
};

enum class Nvfp4ScaleDraw {
  kTypical,    // block scales in [1, 448) as a quantizer writes them for a trained tensor
  kFullRange,  // every E4M3 pattern but NaN: signs, subnormals, zero, 448
};

// Uniform codes; each expert's global scale set so its decoded weights have RMS `weight_rms`.
Nvfp4MoeHost RandomNvfp4Moe(std::mt19937_64& rng, std::int64_t hidden, std::int64_t intermediate,
                            std::int64_t experts, Nvfp4ScaleDraw draw, float weight_rms = 0.05f);

// The hand-computed layer (D = I = `dim`, one expert): every gate row codes 0x22 (all 1.0) at
// block scale 1.0 (0x38), every up row 0x99 (all -0.5) at 2.0 (0x40), global 0.5 for both halves;
// every down row 0x77 (all 6.0) at 0.5 (0x30), global 2. For x = ones: g = dim / 2, u = -dim / 2,
// out = w * dim * 6 * silu(g) * u, in every output (HandComputedNvfp4Output).
Nvfp4MoeHost HandComputedNvfp4Moe(std::int64_t dim);
double HandComputedNvfp4Output(std::int64_t dim, double weight);

// top_k distinct experts per token drawn from the first `pool` experts, weights in (0.1, 1).
struct Nvfp4Routing {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};
Nvfp4Routing RandomNvfp4Routing(std::mt19937_64& rng, std::int64_t tokens, std::int64_t top_k, std::int64_t pool);

// The layer on `backend`.
Nvfp4MoeWeights UploadNvfp4Moe(Backend& backend, const Nvfp4MoeHost& host);

// Runs Backend::Nvfp4Moe on `backend` and returns out [T, D] (a test failure on any error).
std::vector<float> RunNvfp4Moe(Backend& backend, const Nvfp4MoeHost& host, const std::vector<float>& x,
                               const std::vector<std::int32_t>& ids, const std::vector<float>& weights,
                               std::int64_t top_k);

// The op in double from the decoded weights (E2M1 x E4M3 x global), silu(g) * u, k order.
std::vector<double> RefNvfp4Moe(const Nvfp4MoeHost& host, const std::vector<float>& x,
                                const std::vector<std::int32_t>& ids, const std::vector<float>& weights,
                                std::int64_t top_k);

}  // namespace nq::kernels::testing
