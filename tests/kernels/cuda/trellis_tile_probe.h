// A test-only kernel that runs kernels/cuda/trellis_tile.cuh's device functions on given tiles
// and hands back what each produced, so the host can check every weight against the CPU decoder
// (services/quant/trellis_decode.h). The functions read the tile from shared memory, as the
// kernels that will call them do.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::kernels::testing {

struct TrellisTileProbe {
  // Per tile: lane l's A fragment (TileAFragment) as 8 fp16 bit patterns, a0.lo, a0.hi, a1.lo,
  // ..., a3.hi: [tiles][32][8].
  std::vector<std::uint16_t> fragment;
  // Per tile, weight t = 16 r + c: CentredWeight (fp16 bits), CentredWeightInt, and TileRow's
  // output (fp16 bits, row r from words r - 1 and r): [tiles][256] each.
  std::vector<std::uint16_t> single;
  std::vector<std::int32_t> single_int;
  std::vector<std::uint16_t> row;
};

// `words`: tiles * 16 little-endian uint32 words, tile after tile. Synchronous; any CUDA error
// comes back as a status.
absl::StatusOr<TrellisTileProbe> ProbeTrellisTiles(std::span<const std::uint32_t> words);

}  // namespace nq::kernels::testing
