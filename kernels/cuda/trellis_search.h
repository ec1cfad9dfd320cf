// trellis_v1's tile search on one GPU (issue #16): the encoder's Viterbi (services/quant/
// trellis_viterbi.h) for many tiles at once, giving the CPU TileSearcher's symbols bit for bit,
// so `nq encode --device cuda` writes the same release as the CPU.
//
// One tile per thread-block cluster of two SMs: the 65536 states' costs take 256 KB, more than
// one SM's shared memory, so each block holds half of them (by the top state bit) and the steps
// whose butterflies span both halves (every eighth) exchange through distributed shared memory.
// Backpointers (2 bits per group and step, 1 MB per tile) go to global memory for the trace.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "services/quant/trellis_search.h"

namespace nq::kernels::cuda {

// A searcher on `device` (sm_90: thread-block clusters). It keeps its scratch (about 1 MB per
// cluster the GPU runs at once) and grows its tile buffers on demand; Search is not
// thread-safe (one searcher per encoding thread).
absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> MakeCudaTrellisTileSearch(int device);

}  // namespace nq::kernels::cuda
