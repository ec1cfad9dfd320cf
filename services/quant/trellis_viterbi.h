// Tail-biting Viterbi search over trellis_v1's bitshift trellis (trellis_decode.h): the
// symbols of one 256-weight tile whose decoded values are closest (squared error) to the
// tile's targets, among all codes whose state ring closes (s_{-1} = s_255).
//
// Tail-biting by a probe (the usual two-pass approximation): a free-start search over the
// kProbeSteps weights around the ring's seam fixes the seven symbols that the last state
// and the first state share; the full search then starts from those and may only end in a
// state that carries them. Cost per weight: 65536 differences, squares and adds plus 16384
// four-way minima, on (1 + kProbeSteps / 256) = 2 passes.
//
// ---- The search arithmetic (the contract; the CUDA search, kernels/cuda/, keeps it too) ----
// Path costs are IEEE binary16 (fp16), so that the GPU search runs on half2 (two states an
// instruction, all 65536 costs in one SM's shared memory); every encoder must give the same
// symbols, so the CPU computes exactly the same. Measured cost in quality: none (N(0,1), 128
// tiles: 2-bit MSE 0.068092 with fp32 costs, 0.068093 with these; 4-bit residual 0.0046600 and
// 0.0046626). h(y) rounds a float y to the nearest binary16 value (ties to even; |y| >= 65520
// gives +-inf), held exactly in a float (trellis_half.h).
//  - Values: vh[s] = h(values[s]) for every right-shift state s (the constructor's values).
//  - Targets: xh_t = h(min(max(x_t, -kTargetLimit), kTargetLimit)) (max first, so NaN gives
//    -kTargetLimit). No unit value reaches 3.5, so a square stays below (64 + 3.5)^2 < 4600 and
//    the least cost below 8 x 4600 < 65504 between two normalisations: some cost is always
//    finite, and no cost is ever NaN. Beyond 64 the code is the same (every value is far).
//  - Costs: binary16 values, never negative (or +inf). Probe start: all 0. Full-ring start: +inf
//    except the four seam states (0).
//  - Step t of a run (t = 0 .. steps-1): for group g, a_j = cost of predecessor g | j << 14;
//    b01 = a1 < a0; m01 = b01 ? a1 : a0; b23 = a3 < a2; m23 = b23 ? a3 : a2; high = m23 < m01;
//    least = high ? m23 : m01; backpointer j = high ? 2 + b23 : b01 (ties keep the lower j).
//  - Normalisation: when t % 8 == 1, least = h(least - r_t), where r_t is the minimum of all
//    65536 costs as they are before step t (after step t-1); least >= r_t, so the result is >= 0.
//    At other steps least is used as is. (It keeps costs near 0, where binary16's step is fine:
//    on N(0,1) the best cost grows ~0.07 a weight, so a tile's would reach ~18, step 2^-6.)
//  - Successor c (0..3), s' = g << 2 | c: d = h(xh_t - vh[LeftToRight(s')]); sq = h(d * d);
//    cost[s'] = h(least + sq). Three separately rounded operations, no fused multiply-add.
//  - Probe end: the lowest state index among the minimal costs. Full end: among the four seam
//    states the least cost, ties to the lower j.
//  - Search's returned error and `decoded` come from the float values (DecodeRing), not vh.
// Computing in float and then rounding is exact: for +, - and * of two binary16 values, rounding
// the float result to binary16 equals the binary16 operation (float's 24 bits >= 2 * 11 + 2, so
// the double rounding is innocuous), and comparisons of binary16 values held in floats are exact.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "services/quant/trellis_decode.h"

namespace nq::quant::trellis {

// Weights around the seam the probe searches (half before, half after): the whole ring.
// Measured MSE on N(0,1) (128-256 tiles, same data): probe 64 -> 0.0704, 128 -> 0.0699,
// 256 -> 0.0694-0.0697; survivor paths of this trellis merge slowly, and the target
// is 0.070, so the probe costs one full extra pass (2 passes per tile in all).
inline constexpr int kProbeSteps = kTileWeights;

// The targets' clamp in the search arithmetic above (unit-scaled targets: 64 standard deviations).
inline constexpr float kTargetLimit = 64.0f;

// The unit codebook, one value per right-shift state (trellis_decode.h's UnitValue), built once.
const std::vector<float>& UnitValues();

// The decoded values of a tile's ring of 256 symbols (values: by right-shift state, as
// UnitValues), and their squared error against targets x.
double DecodeRing(std::span<const float> values, const float* x, const uint8_t* symbols, float* decoded);

// One searcher owns ~6.5 MiB of scratch (layout tables, costs, backpointers): make one per thread
// and reuse it across tiles.
class TileSearcher {
 public:
  // kBest takes the AVX2 + F16C steps where the CPU has them; kPortable keeps to SSE2 (x86-64's
  // baseline) so tests can check that both give the same symbols on a machine with AVX2.
  enum class Isa { kBest, kPortable };

  // `values`: the decoded value of every state (kStateCount entries, gain applied); the search
  // uses them rounded to binary16 (above).
  explicit TileSearcher(std::span<const float> values, Isa isa = Isa::kBest);

  // Finds the code of one tile: targets x[0..255] in tile order; writes the 256 symbols
  // (each 0..3) and the decoded values, and returns the tile's squared error.
  double Search(const float* x, uint8_t* symbols, float* decoded);

 private:
  // Trellis step t of a run (layout in trellis_viterbi.cc), in place, as the contract above
  // says: every state's cost becomes the least cost of its four predecessors (less `floor` when
  // `normalise`) plus (xh - vh)^2; the argmin goes to bp. xh: the rounded target.
  void Step(int t, float xh, bool normalise, float floor, uint8_t* bp);
  // The least of all costs (r_t of the contract).
  float LeastCost() const;
  // Runs `steps` steps over targets x from the costs in cost_ (natural layout in and out).
  void Run(const float* x, int steps);
  // Traces the path ending in left-shift `state` back through `steps` steps.
  void Trace(uint32_t state, int steps, uint8_t* symbols) const;

  Isa isa_;
  std::vector<float> values_;         // by right-shift state (trellis_decode.h), as given
  std::vector<float> layout_values_;  // vh per layout phase, by position
  std::vector<uint16_t> cost_;        // binary16 bit patterns, by position (trellis_viterbi.cc)
  std::vector<uint8_t> backpointers_;  // per step, per group
};

}  // namespace nq::quant::trellis
