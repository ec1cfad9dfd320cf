// CPU reference NVFP4 dequant-GEMV. The 256-entry byte table turns one packed byte into its two
// E2M1 values with one load, the way a device kernel would use a shared-memory table.
#include "kernels/cpu/nvfp4_gemv.h"

#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/parallel.h"
#include "kernels/nvfp4_codes.h"

namespace nq::kernels::cpu {
namespace {

struct BytePair {
  float low;   // element 2j
  float high;  // element 2j + 1
};

const std::array<BytePair, 256>& PairTable() {
  static const std::array<BytePair, 256> table = [] {
    std::array<BytePair, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = {E2M1ToFloat(static_cast<std::uint8_t>(b & 0x0F)),
              E2M1ToFloat(static_cast<std::uint8_t>(b >> 4))};
    }
    return t;
  }();
  return table;
}

// Outputs per chunk below which threads cost more than they save.
constexpr std::int64_t kMinRowsPerThread = 64;

void GemvRows(const Nvfp4GemvParams& p, std::int64_t row_begin, std::int64_t row_end) {
  const std::array<BytePair, 256>& table = PairTable();
  const std::int64_t blocks = p.k / kNvfp4BlockSize;
  constexpr int kBytesPerBlock = kNvfp4BlockSize / 2;
  for (std::int64_t row = row_begin; row < row_end; ++row) {
    const std::uint8_t* packed_row = p.packed + row * (p.k / 2);
    const std::uint8_t* scale_row = p.scales + row * blocks;
    for (std::int64_t t = 0; t < p.m; ++t) {
      const float* x = p.x + t * p.k;
      float acc = 0.0f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::uint8_t* bytes = packed_row + b * kBytesPerBlock;
        const float* xb = x + b * kNvfp4BlockSize;
        float block_sum = 0.0f;
        for (int j = 0; j < kBytesPerBlock; ++j) {
          const BytePair& pair = table[bytes[j]];
          block_sum += pair.low * xb[2 * j] + pair.high * xb[2 * j + 1];
        }
        acc += block_sum * E4M3ToFloat(scale_row[b]);
      }
      p.y[t * p.n + row] = acc * p.global_scale;
    }
  }
}

}  // namespace

absl::Status Nvfp4Gemv(const Nvfp4GemvParams& params, int threads) {
  if (params.packed == nullptr || params.scales == nullptr || params.x == nullptr ||
      params.y == nullptr) {
    return absl::InvalidArgumentError("Nvfp4Gemv: null pointer");
  }
  if (params.m <= 0 || params.n <= 0 || params.k <= 0 || params.k % kNvfp4BlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Nvfp4Gemv: want m, n, k > 0 and k % 16 == 0, got m=",
                                                   params.m, " n=", params.n, " k=", params.k));
  }
  if (!std::isfinite(params.global_scale)) {
    return absl::InvalidArgumentError("Nvfp4Gemv: non-finite global scale");
  }
  ParallelFor(params.n, kMinRowsPerThread, threads,
              [&](std::int64_t begin, std::int64_t end) { GemvRows(params, begin, end); });
  return absl::OkStatus();
}

}  // namespace nq::kernels::cpu
