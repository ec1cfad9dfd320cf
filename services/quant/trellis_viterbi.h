// Tail-biting Viterbi search over trellis_v1's bitshift trellis (trellis_decode.h): the
// symbols of one 256-weight tile whose decoded values are closest (squared error) to the
// tile's targets, among all codes whose state ring closes (s_{-1} = s_255).
//
// Tail-biting by a probe (the usual two-pass approximation): a free-start search over the
// kProbeSteps weights around the ring's seam fixes the seven symbols that the last state
// and the first state share; the full search then starts from those and may only end in a
// state that carries them. Cost per weight: 65536 adds and squared errors plus 16384
// four-way minima, on (1 + kProbeSteps / 256) = 2 passes.
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

// The unit codebook, one value per right-shift state (trellis_decode.h's UnitValue), built once.
const std::vector<float>& UnitValues();

// The decoded values of a tile's ring of 256 symbols (values: by right-shift state, as
// UnitValues), and their squared error against targets x.
double DecodeRing(std::span<const float> values, const float* x, const uint8_t* symbols, float* decoded);

// One searcher owns ~6.5 MiB of scratch (layout tables, costs, backpointers): make one per thread
// and reuse it across tiles.
class TileSearcher {
 public:
  // kBest takes the AVX2 steps where the CPU has them; kPortable keeps to SSE2 (x86-64's baseline)
  // so tests can check that both give the same symbols on a machine with AVX2.
  enum class Isa { kBest, kPortable };

  // `values`: the decoded value of every state (kStateCount entries, gain applied).
  explicit TileSearcher(std::span<const float> values, Isa isa = Isa::kBest);

  // Finds the code of one tile: targets x[0..255] in tile order; writes the 256 symbols
  // (each 0..3) and the decoded values, and returns the tile's squared error.
  double Search(const float* x, uint8_t* symbols, float* decoded);

 private:
  // Trellis step t of a run (layout in trellis_viterbi.cc): in place, every state's cost
  // becomes the least cost of its four predecessors plus (x - value)^2; the argmin goes to bp.
  void Step(int t, float x, uint8_t* bp);
  // Runs `steps` steps over targets x from the costs in cost_ (natural layout in and out).
  void Run(const float* x, int steps);
  // Traces the path ending in left-shift `state` back through `steps` steps.
  void Trace(uint32_t state, int steps, uint8_t* symbols) const;

  Isa isa_;
  std::vector<float> values_;         // by right-shift state (trellis_decode.h)
  std::vector<float> layout_values_;  // per layout phase, by position
  std::vector<float> cost_;
  std::vector<uint8_t> backpointers_;  // per step, per group
};

}  // namespace nq::quant::trellis
