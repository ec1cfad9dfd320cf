// trellis_v1's tile search on one GPU (issue #16): the encoder's Viterbi (services/quant/
// trellis_viterbi.h) for many tiles at once, giving the CPU TileSearcher's symbols bit for bit,
// so `nq encode --device cuda` writes the same release as the CPU.
//
// One tile per 1024-thread block: the search's binary16 costs of the 65536 states take 128 KB of
// the SM's shared memory, and every instruction steps two groups (half2 arithmetic).
// Backpointers (2 bits per group and step, 1 MB per block) go to global memory for the trace.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "services/quant/trellis_search.h"

namespace nq::kernels::cuda {

// A searcher on `device` (sm_90). It keeps its scratch (about 1 MB per block the GPU runs at
// once) and grows its tile buffers on demand; Search is not thread-safe (one searcher per
// encoding thread).
absl::StatusOr<std::unique_ptr<quant::TrellisTileSearch>> MakeCudaTrellisTileSearch(int device);

}  // namespace nq::kernels::cuda
