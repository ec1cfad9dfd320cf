// CUDA Embedding vs the CPU backend on fresh random tables, F32 / BF16 / F16: a lookup, so the
// results must be identical.
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
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

TEST(CudaEmbedding, MatchesCpuExactly) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3101);
  struct Case {
    std::int64_t vocab, dim, tokens;
  };
  // 129280 x 7168: DeepSeek-V3's table (BF16, 1.8 GiB) would be too much host work; a slice of
  // its width with a few thousand rows exercises the same kernel.
  const std::vector<Case> cases = {{1, 1, 1}, {37, 24, 5}, {1000, 7168, 64}, {4099, 129, 2048}};
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " V=", c.vocab, " d=", c.dim, " T=", c.tokens));
      const std::vector<float> table = RandomNormal(rng, c.vocab * c.dim, 1.0f);
      std::vector<std::int32_t> ids(c.tokens);
      for (std::int32_t& id : ids) id = static_cast<std::int32_t>(RandomInt(rng, 0, c.vocab - 1));
      std::vector<float> outputs[2];
      int i = 0;
      for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
        Tensor tt = Upload(*backend, table, dtype, {c.vocab, c.dim});
        Tensor out = AllocateOrFail(*backend, DType::kF32, {c.tokens, c.dim});
        NQ_ASSERT_OK(backend->Embedding(ids, tt, out));
        outputs[i++] = Download(*backend, out);
      }
      EXPECT_TRUE(outputs[1] == outputs[0]);
    }
  }
}

}  // namespace
}  // namespace nq::kernels
