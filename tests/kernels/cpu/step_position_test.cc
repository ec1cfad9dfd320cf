// Ops at a position read from a device tensor (kernels/step_position.h) against the same ops at a
// host position: the CPU backend reads the tensor when the op runs, so the results must be
// identical; a value past the bound, a malformed position tensor, a bound the cache cannot hold
// and out-of-range device ids are refused. The CPU backend cannot capture graphs.
#include <cstdint>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::MlaInputs;
using ::nq::kernels::testing::MlaShape;
using ::nq::kernels::testing::RandomMlaInputs;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RunIndexerTopK;
using ::nq::kernels::testing::RunMlaAttention;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

Tensor Position(Backend& backend, std::int32_t value) {
  return UploadI32(backend, std::span<const std::int32_t>(&value, 1), {1});
}

const std::vector<float> kInvFreq = {1.0f, 0.1f, 0.01f, 0.001f};

TEST(StepPosition, DeviceRopeEqualsHost) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(8101);
  const std::vector<float> values = RandomNormal(rng, 3 * 2 * 8, 1.0f);
  Tensor host = Upload(*backend, values, DType::kF32, {3, 2, 8});
  Tensor device = Upload(*backend, values, DType::kF32, {3, 2, 8});
  Tensor position = Position(*backend, 37);
  ASSERT_TRUE(backend->Rope(host, 37, kInvFreq, 1.0f, true).ok());
  ASSERT_TRUE(backend->Rope(device, StepPosition::OnDevice(position, 500), kInvFreq, 1.0f, true).ok());
  EXPECT_EQ(Download(*backend, device), Download(*backend, host));
}

TEST(StepPosition, DeviceWriteRowsEqualsHostIntoF32AndBf16) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(8102);
  const std::vector<float> rows = RandomNormal(rng, 2 * 6, 1.0f);
  Tensor src = Upload(*backend, rows, DType::kF32, {2, 6});
  Tensor position = Position(*backend, 5);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::vector<float> zeros(16 * 6, 0.0f);
    Tensor host = Upload(*backend, zeros, dtype, {16, 6});
    Tensor device = Upload(*backend, zeros, dtype, {16, 6});
    ASSERT_TRUE(backend->WriteRows(src, host, 5).ok());
    ASSERT_TRUE(backend->WriteRows(src, device, StepPosition::OnDevice(position, 14)).ok());
    EXPECT_EQ(Download(*backend, device), Download(*backend, host)) << DTypeName(dtype);
  }
}

TEST(StepPosition, DeviceMlaAttentionEqualsHostDenseAndSelected) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(8103);
  const MlaShape shape{.tokens = 2, .heads = 4, .dn = 16, .dr = 16, .c = 32, .dv = 16, .keys = 64, .start_pos = 20};
  const MlaInputs in = RandomMlaInputs(rng, shape, DType::kF32, DType::kF32);
  // DSA: keys 0, 3, 6, ... of each query, some past its position (-1 padded).
  std::vector<std::int32_t> selected;
  for (std::int64_t t = 0; t < shape.tokens; ++t) {
    for (std::int32_t j = 0; j < 12; ++j) selected.push_back(j < 10 ? 3 * j : -1);
  }
  for (bool dsa : {false, true}) {
    const std::span<const std::int32_t> sel = dsa ? std::span<const std::int32_t>(selected) : std::span<const std::int32_t>();
    const std::vector<float> host = RunMlaAttention(*backend, shape, in, DType::kF32, DType::kF32, sel, 12, 0.1f);
    const std::vector<float> device =
        RunMlaAttention(*backend, shape, in, DType::kF32, DType::kF32, sel, 12, 0.1f, DType::kF32, 60);
    ASSERT_FALSE(host.empty());
    EXPECT_EQ(device, host) << (dsa ? "DSA" : "dense");
  }
}

TEST(StepPosition, DeviceIndexerTopKEqualsHost) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(8104);
  const std::int64_t tokens = 3, heads = 4, dim = 8, keys = 100, start = 40, top_k = 16;
  const std::vector<float> q = RandomNormal(rng, tokens * heads * dim, 1.0f);
  const std::vector<float> k = RandomNormal(rng, keys * dim, 1.0f);
  const std::vector<float> w = RandomNormal(rng, tokens * heads, 1.0f);
  const std::vector<std::int32_t> host = RunIndexerTopK(*backend, q, k, w, tokens, heads, dim, keys, start, top_k);
  const std::vector<std::int32_t> device =
      RunIndexerTopK(*backend, q, k, w, tokens, heads, dim, keys, start, top_k, keys - tokens);
  ASSERT_FALSE(host.empty());
  EXPECT_EQ(device, host);
}

TEST(StepPosition, DeviceEmbeddingEqualsHostAndRefusesAnIdOutsideTheTable) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(8105);
  Tensor table = Upload(*backend, RandomNormal(rng, 10 * 4, 1.0f), DType::kF32, {10, 4});
  const std::vector<std::int32_t> ids = {7, 0, 9};
  Tensor device_ids = UploadI32(*backend, ids, {3});
  Tensor host = AllocateOrFail(*backend, DType::kF32, {3, 4});
  Tensor device = AllocateOrFail(*backend, DType::kF32, {3, 4});
  ASSERT_TRUE(backend->Embedding(ids, table, host).ok());
  ASSERT_TRUE(backend->Embedding(device_ids, table, device).ok());
  EXPECT_EQ(Download(*backend, device), Download(*backend, host));

  const std::vector<std::int32_t> bad = {7, 10, 1};
  Tensor bad_ids = UploadI32(*backend, bad, {3});
  EXPECT_THAT(backend->Embedding(bad_ids, table, device),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ids[1] = 10")));
  Tensor wrong_shape = UploadI32(*backend, ids, {3});
  Tensor out2 = AllocateOrFail(*backend, DType::kF32, {2, 4});
  EXPECT_THAT(backend->Embedding(wrong_shape, table, out2), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out")));
}

TEST(StepPosition, RefusesAValuePastItsBoundAMalformedTensorAndABoundTheCacheCannotHold) {
  auto backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(8106);
  Tensor x = Upload(*backend, RandomNormal(rng, 2 * 1 * 8, 1.0f), DType::kF32, {2, 1, 8});
  Tensor position = Position(*backend, 41);
  EXPECT_THAT(backend->Rope(x, StepPosition::OnDevice(position, 40), kInvFreq, 1.0f, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside [0, 40]")));

  Tensor as_float = Upload(*backend, std::vector<float>{3.0f}, DType::kF32, {1});
  EXPECT_THAT(backend->Rope(x, StepPosition::OnDevice(as_float, 40), kInvFreq, 1.0f, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be I32 [1]")));
  Tensor two = UploadI32(*backend, std::vector<std::int32_t>{1, 2}, {2});
  EXPECT_THAT(backend->Rope(x, StepPosition::OnDevice(two, 40), kInvFreq, 1.0f, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be I32 [1]")));

  // The bound, not the value, is checked against the cache when the op is enqueued.
  Tensor src = Upload(*backend, RandomNormal(rng, 2 * 6, 1.0f), DType::kF32, {2, 6});
  Tensor cache = AllocateOrFail(*backend, DType::kF32, {16, 6});
  Tensor small = Position(*backend, 1);
  EXPECT_THAT(backend->WriteRows(src, cache, StepPosition::OnDevice(small, 15)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
  EXPECT_TRUE(backend->WriteRows(src, cache, StepPosition::OnDevice(small, 14)).ok());
}

TEST(StepPosition, TheCpuBackendCannotCapture) {
  auto backend = MakeCpuBackend();
  EXPECT_FALSE(backend->CanCapture());
  EXPECT_THAT(backend->BeginCapture(), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("cannot capture")));
  EXPECT_EQ(backend->EndCapture().status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace nq::kernels
