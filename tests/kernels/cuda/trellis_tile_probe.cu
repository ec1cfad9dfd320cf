#include "tests/kernels/cuda/trellis_tile_probe.h"

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/trellis_tile.cuh"
#include "services/common/status_macros.h"

namespace nq::kernels::testing {
namespace {

namespace trellis = ::nq::kernels::cuda::trellis;
constexpr int kWarp = 32;
constexpr int kWeights = 256;

struct ProbeParams {
  const std::uint32_t* words = nullptr;  // [tiles][16]
  std::uint16_t* fragment = nullptr;     // [tiles][32][8]
  std::uint16_t* single = nullptr;       // [tiles][256]
  std::int32_t* single_int = nullptr;    // [tiles][256]
  std::uint16_t* row = nullptr;          // [tiles][256]
};

__device__ std::uint16_t Bits(__half h) { return __half_as_ushort(h); }

// One warp per tile.
__global__ void __launch_bounds__(kWarp) TrellisTileProbeKernel(const __grid_constant__ ProbeParams p) {
  __shared__ std::uint32_t words[trellis::kTileWords];
  const int tile = blockIdx.x, lane = threadIdx.x;
  if (lane < trellis::kTileWords) words[lane] = p.words[tile * trellis::kTileWords + lane];
  __syncwarp();

  __half2 a[4];
  trellis::TileAFragment(words, lane, a);
  std::uint16_t* frag = p.fragment + (tile * kWarp + lane) * 8;
  for (int i = 0; i < 4; ++i) {
    frag[2 * i] = Bits(__low2half(a[i]));
    frag[2 * i + 1] = Bits(__high2half(a[i]));
  }
  for (int t = lane; t < kWeights; t += kWarp) {
    const int r = t / trellis::kTileDim, c = t % trellis::kTileDim;
    p.single[tile * kWeights + t] = Bits(trellis::CentredWeight(words, r, c));
    p.single_int[tile * kWeights + t] = trellis::CentredWeightInt(words, r, c);
  }
  if (lane < trellis::kTileDim) {
    __half2 row[8];
    trellis::TileRow(words[(lane + trellis::kTileWords - 1) % trellis::kTileWords], words[lane], row);
    for (int i = 0; i < 8; ++i) {
      p.row[tile * kWeights + lane * trellis::kTileDim + 2 * i] = Bits(__low2half(row[i]));
      p.row[tile * kWeights + lane * trellis::kTileDim + 2 * i + 1] = Bits(__high2half(row[i]));
    }
  }
}

template <class T>
absl::Status CopyBack(const cuda::DeviceBuffer& from, std::vector<T>& to, std::size_t count) {
  to.resize(count);
  NQ_CUDA_RETURN_IF_ERROR(cudaMemcpy(to.data(), from.get(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrellisTileProbe> ProbeTrellisTiles(std::span<const std::uint32_t> words) {
  const std::size_t tiles = words.size() / trellis::kTileWords;
  if (tiles == 0 || words.size() % trellis::kTileWords != 0) {
    return absl::InvalidArgumentError("ProbeTrellisTiles: want a positive whole number of 16-word tiles");
  }
  ASSIGN_OR_RETURN(cuda::DeviceBuffer d_words, cuda::DeviceBuffer::Allocate(words.size_bytes()));
  ASSIGN_OR_RETURN(cuda::DeviceBuffer d_fragment, cuda::DeviceBuffer::Allocate(tiles * kWarp * 8 * sizeof(std::uint16_t)));
  ASSIGN_OR_RETURN(cuda::DeviceBuffer d_single, cuda::DeviceBuffer::Allocate(tiles * kWeights * sizeof(std::uint16_t)));
  ASSIGN_OR_RETURN(cuda::DeviceBuffer d_int, cuda::DeviceBuffer::Allocate(tiles * kWeights * sizeof(std::int32_t)));
  ASSIGN_OR_RETURN(cuda::DeviceBuffer d_row, cuda::DeviceBuffer::Allocate(tiles * kWeights * sizeof(std::uint16_t)));
  NQ_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_words.get(), words.data(), words.size_bytes(), cudaMemcpyHostToDevice));
  const ProbeParams p{.words = static_cast<const std::uint32_t*>(d_words.get()),
                      .fragment = static_cast<std::uint16_t*>(d_fragment.get()),
                      .single = static_cast<std::uint16_t*>(d_single.get()),
                      .single_int = static_cast<std::int32_t*>(d_int.get()),
                      .row = static_cast<std::uint16_t*>(d_row.get())};
  TrellisTileProbeKernel<<<static_cast<unsigned>(tiles), kWarp>>>(p);
  RETURN_IF_ERROR(cuda::CheckLaunch("TrellisTileProbeKernel"));
  NQ_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  TrellisTileProbe out;
  RETURN_IF_ERROR(CopyBack(d_fragment, out.fragment, tiles * kWarp * 8));
  RETURN_IF_ERROR(CopyBack(d_single, out.single, tiles * kWeights));
  RETURN_IF_ERROR(CopyBack(d_int, out.single_int, tiles * kWeights));
  RETURN_IF_ERROR(CopyBack(d_row, out.row, tiles * kWeights));
  return out;
}

}  // namespace nq::kernels::testing
