// How the buffers that captured step graphs point into grow: the backend's scratch and MoE
// workspace, and the model's routing staging. A new block invalidates every graph (they would
// read freed memory), and the next steps of each key run op by op and capture again (about 1-3 ms
// each on the H200, against 0.3 ms replayed). Sized exactly, every prompt a token longer than
// any before it did that; doubling bounds it to a few times over a worker's life, with at most
// kMaxGrowthSlack bytes beyond what was asked so the large blocks (a long prefill's dense MoE
// workspace) do not double.
#pragma once

#include <algorithm>
#include <cstddef>

namespace nq::kernels {

inline constexpr std::size_t kMaxGrowthSlack = std::size_t{256} << 20;

// The size to allocate for `need` bytes when `current` are held (need > current): twice the
// current size where that is at most kMaxGrowthSlack past the need, else the need plus that.
constexpr std::size_t GrownCapacity(std::size_t need, std::size_t current) {
  if (need <= current) return current;
  return std::max(need, std::min(2 * current, need + kMaxGrowthSlack));
}

}  // namespace nq::kernels
