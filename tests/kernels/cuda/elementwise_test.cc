// CUDA Add vs the CPU backend: fp32 addition is exact to compare, in and out of place.
#include <cstdint>
#include <vector>

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

TEST(CudaAdd, MatchesCpuExactlyInAndOutOfPlace) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3201);
  // Counts that are and are not multiples of the float4 path, up to a 16384 x 7168 residual.
  std::vector<std::int64_t> counts = {1, 3, 4, 1027, 7168, 16384 * 7168};
  for (int i = 0; i < 3; ++i) counts.push_back(RandomInt(rng, 1, 1 << 20));
  for (std::int64_t count : counts) {
    SCOPED_TRACE(count);
    const std::vector<float> a = RandomNormal(rng, count, 1.0f);
    const std::vector<float> b = RandomNormal(rng, count, 1.0f);
    std::vector<float> out_of_place[2];
    std::vector<float> in_place[2];
    int i = 0;
    for (Backend* backend : {Backends().cpu.get(), Backends().cuda.get()}) {
      Tensor ta = Upload(*backend, a, DType::kF32, {count});
      Tensor tb = Upload(*backend, b, DType::kF32, {count});
      Tensor out = AllocateOrFail(*backend, DType::kF32, {count});
      NQ_ASSERT_OK(backend->Add(ta, tb, out));
      NQ_ASSERT_OK(backend->Add(ta, tb, ta));
      out_of_place[i] = Download(*backend, out);
      in_place[i++] = Download(*backend, ta);
    }
    EXPECT_TRUE(out_of_place[1] == out_of_place[0]);
    EXPECT_TRUE(in_place[1] == in_place[0]);
  }
}

}  // namespace
}  // namespace nq::kernels
