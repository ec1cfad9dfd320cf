// CUDA WriteRows (F32 and BF16 caches) / GatherRows / ScatterAddRows vs the CPU backend. Row moves
// are copies or the same round-to-nearest-even conversion, and the scatter adds in the CPU's order
// with the same roundings, so all three must match exactly.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_fp8.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;

TEST(CudaWriteRows, MatchesCpuExactly) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3501);
  // A latent KV cache: 4096 rows of 576 (c + dr); write a prefill chunk, then a decode row.
  constexpr std::int64_t kRows = 4096, kCols = 576;
  const std::vector<float> cache = RandomNormal(rng, kRows * kCols, 1.0f);
  const std::vector<float> chunk = RandomNormal(rng, 300 * kCols, 1.0f);
  const std::vector<float> row = RandomNormal(rng, kCols, 1.0f);
  std::vector<float> outputs[2];
  int i = 0;
  for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
    Tensor tcache = Upload(*backend, cache, DType::kF32, {kRows, kCols});
    Tensor tchunk = Upload(*backend, chunk, DType::kF32, {300, kCols});
    Tensor trow = Upload(*backend, row, DType::kF32, {1, kCols});
    NQ_ASSERT_OK(backend->WriteRows(tchunk, tcache, 1000));
    NQ_ASSERT_OK(backend->WriteRows(trow, tcache, kRows - 1));
    outputs[i++] = Download(*backend, tcache);
  }
  EXPECT_TRUE(outputs[1] == outputs[0]);
}

TEST(CudaWriteRows, Bf16CacheMatchesCpuBitForBit) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3503);
  // A BF16 latent cache (c = 512) and rope-key cache (dr = 64): a prefill chunk, a decode row at
  // the end, and odd widths and offsets (the destination need not be aligned). Both backends
  // round to nearest even, so the stored bits must agree exactly; ties are planted on purpose.
  struct Case {
    std::int64_t rows, cols, chunk, offset;
  };
  const std::vector<Case> cases = {{4096, 512, 300, 1000}, {4096, 64, 1, 4095}, {37, 3, 5, 11}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("rows=", c.rows, " cols=", c.cols, " chunk=", c.chunk,
                              " offset=", c.offset));
    std::vector<float> chunk = RandomNormal(rng, c.chunk * c.cols, 2.0f);
    // Every 7th value becomes an exact tie: its low 16 bits are 0x8000.
    for (std::size_t i = 0; i < chunk.size(); i += 7) {
      std::uint32_t bits;
      std::memcpy(&bits, &chunk[i], sizeof(bits));
      bits = (bits & 0xffff0000u) | 0x8000u;
      std::memcpy(&chunk[i], &bits, sizeof(bits));
    }
    const std::vector<float> cache = RandomNormal(rng, c.rows * c.cols, 1.0f);
    std::vector<float> outputs[2];
    int i = 0;
    for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
      Tensor tcache = Upload(*backend, cache, DType::kBF16, {c.rows, c.cols});
      Tensor tchunk = Upload(*backend, chunk, DType::kF32, {c.chunk, c.cols});
      NQ_ASSERT_OK(backend->WriteRows(tchunk, tcache, c.offset));
      outputs[i++] = Download(*backend, tcache);
    }
    ASSERT_EQ(outputs[0].size(), outputs[1].size());
    EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[1].data(), outputs[0].size() * sizeof(float)), 0);
  }
}

// Packed FP8 rows (kernels/kv_fp8.h): the CUDA pack kernel must store the CPU's bytes, codes,
// scales and padding, at a host offset and at a device one (a step graph's), for DeepSeek-V3's
// and GLM-5's c = 512, glm5_nano's 64 and widths that end mid-tile. The rows hold ties, values
// deep below their tile's largest (subnormal codes), a zero tile, a NaN tile and infinities.
TEST(CudaWriteRows, Fp8RowsMatchCpuBitForBit) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3505);
  struct Case {
    std::int64_t rows, c, chunk, offset;
    bool device_offset;
  };
  const std::vector<Case> cases = {{4096, 512, 300, 1000, false}, {4096, 512, 1, 4095, true},
                                   {200, 64, 7, 190, true},        {37, 160, 5, 11, false},
                                   {37, 40, 3, 30, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("rows=", c.rows, " c=", c.c, " chunk=", c.chunk, " offset=", c.offset,
                              c.device_offset ? " (device offset)" : ""));
    std::vector<float> chunk = RandomNormal(rng, c.chunk * c.c, 2.0f);
    for (std::size_t i = 3; i < chunk.size(); i += 11) chunk[i] *= 1e-4f;  // subnormal codes
    for (std::size_t i = 5; i < chunk.size(); i += 17) chunk[i] = std::round(chunk[i] * 4) / 4;  // exact steps
    const std::int64_t tile = std::min<std::int64_t>(c.c, kKvFp8Tile);
    std::fill(chunk.begin(), chunk.begin() + tile, 0.0f);  // row 0: a zero tile
    if (c.chunk > 1) chunk[c.c + 1] = std::numeric_limits<float>::quiet_NaN();  // row 1: a NaN tile
    if (c.chunk > 2) {
      chunk[2 * c.c] = std::numeric_limits<float>::infinity();
      chunk[2 * c.c + 2] = -std::numeric_limits<float>::quiet_NaN();
    }
    const std::int64_t width = KvFp8RowBytes(c.c);
    std::vector<std::uint8_t> bytes[2];
    int i = 0;
    for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
      Tensor tcache = AllocateOrFail(*backend, DType::kU8, {c.rows, width});
      std::vector<std::byte> fill(static_cast<std::size_t>(tcache.nbytes()), std::byte{0xee});
      NQ_ASSERT_OK(backend->CopyFromHost(fill, tcache));
      Tensor tchunk = Upload(*backend, chunk, DType::kF32, {c.chunk, c.c});
      Tensor position;
      if (c.device_offset) {
        const std::int32_t offset = static_cast<std::int32_t>(c.offset);
        position = UploadI32(*backend, std::span<const std::int32_t>(&offset, 1), {1});
        NQ_ASSERT_OK(backend->WriteRows(tchunk, tcache, StepPosition::OnDevice(position, c.rows - c.chunk)));
      } else {
        NQ_ASSERT_OK(backend->WriteRows(tchunk, tcache, StepPosition(c.offset)));
      }
      bytes[i].resize(static_cast<std::size_t>(tcache.nbytes()));
      NQ_ASSERT_OK(backend->CopyToHost(tcache, std::as_writable_bytes(std::span(bytes[i]))));
      ++i;
    }
    ASSERT_EQ(bytes[0].size(), bytes[1].size());
    for (std::int64_t r = 0; r < c.rows; ++r) {
      ASSERT_EQ(std::memcmp(bytes[0].data() + r * width, bytes[1].data() + r * width, width), 0) << "row " << r;
    }
  }
}

TEST(CudaGatherAndScatterAddRows, MatchCpuExactly) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3502);
  struct Case {
    std::int64_t tokens, n, cols;
  };
  // MoE shapes: tokens x top-8 routes over a 7168-wide hidden state; repeated rows everywhere.
  std::vector<Case> cases = {{1, 1, 1}, {4, 9, 17}, {64, 512, 7168}, {1, 8, 7168}};
  for (int i = 0; i < 3; ++i) {
    cases.push_back({RandomInt(rng, 1, 200), RandomInt(rng, 1, 1600), RandomInt(rng, 1, 3000)});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("T=", c.tokens, " n=", c.n, " cols=", c.cols));
    const std::vector<float> x = RandomNormal(rng, c.tokens * c.cols, 1.0f);
    const std::vector<float> src = RandomNormal(rng, c.n * c.cols, 1.0f);
    std::vector<std::int32_t> rows(c.n);
    std::vector<float> weights(c.n);
    for (std::int64_t i = 0; i < c.n; ++i) {
      rows[i] = static_cast<std::int32_t>(RandomInt(rng, 0, c.tokens - 1));
      weights[i] = static_cast<float>(RandomInt(rng, 1, 1000)) / 997.0f;
    }
    std::vector<float> gathered[2];
    std::vector<float> scattered[2];
    int i = 0;
    for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
      Tensor tx = Upload(*backend, x, DType::kF32, {c.tokens, c.cols});
      Tensor tg = AllocateOrFail(*backend, DType::kF32, {c.n, c.cols});
      NQ_ASSERT_OK(backend->GatherRows(tx, rows, tg));
      Tensor tsrc = Upload(*backend, src, DType::kF32, {c.n, c.cols});
      NQ_ASSERT_OK(backend->ScatterAddRows(tsrc, rows, weights, tx));
      gathered[i] = Download(*backend, tg);
      scattered[i++] = Download(*backend, tx);
    }
    EXPECT_TRUE(gathered[1] == gathered[0]);
    EXPECT_TRUE(scattered[1] == scattered[0]);
  }
}

}  // namespace
}  // namespace nq::kernels
