// The backend-independent parts: CreateBackend, Tensor, copies and dtype conversion.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "kernels/grow_capacity.h"
#include "kernels/tensor_io.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CreateBackend, CpuIsAlwaysAvailable) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu");
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_THAT((*backend)->DeviceDescription(), HasSubstr("threads"));
  EXPECT_TRUE(IsBackendCompiledIn("cpu"));
}

TEST(CreateBackend, UnknownNameIsInvalidArgument) {
  EXPECT_THAT(CreateBackend("tpu").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown backend 'tpu'")));
}

TEST(CreateBackend, CudaIsUnimplementedWithoutCudaOrNeedsADevice) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cuda");
  if (!IsBackendCompiledIn("cuda")) {
    EXPECT_THAT(backend.status(), StatusIs(absl::StatusCode::kUnimplemented,
                                           HasSubstr("not compiled into this build")));
  } else if (!backend.ok()) {
    // A CUDA build on a machine without a GPU (CI) must say so, not crash.
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition)
        << backend.status();
  }
}

TEST(CreateBackend, TheDecodeGemvChoiceIsNamedAndOnlyForCuda) {
  for (const auto& [name, gemv] : {std::pair{"auto", DecodeGemv::kAuto}, std::pair{"tensor", DecodeGemv::kTensorCores},
                                    std::pair{"fma", DecodeGemv::kFp32Fma}}) {
    absl::StatusOr<DecodeGemv> parsed = ParseDecodeGemv(name);
    ASSERT_TRUE(parsed.ok()) << name << ": " << parsed.status();
    EXPECT_EQ(*parsed, gemv) << name;
  }
  EXPECT_THAT(ParseDecodeGemv("TENSOR").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected auto, tensor or fma")));
  EXPECT_THAT(CreateBackend("cpu", {.cuda_decode_gemv = DecodeGemv::kTensorCores}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("applies to the cuda backend")));
  EXPECT_TRUE(CreateBackend("cpu", {.cuda_decode_gemv = DecodeGemv::kAuto}).ok());
}

TEST(Tensor, AllocateReportsDTypeShapeAndBytes) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor t = AllocateOrFail(*backend, DType::kBF16, {3, 5});
  EXPECT_TRUE(t.valid());
  EXPECT_EQ(t.dtype(), DType::kBF16);
  EXPECT_EQ(t.shape(), Shape({3, 5}));
  EXPECT_EQ(t.NumElements(), 15);
  EXPECT_EQ(t.nbytes(), 30u);
  EXPECT_EQ(t.backend_id(), backend->id());
  EXPECT_EQ(t.DebugString(), "BF16[3, 5]");
}

TEST(Tensor, AllocateRejectsNegativeAndOverflowingShapes) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  EXPECT_THAT(backend->Allocate(DType::kF32, {2, -1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("negative dimension in [2, -1]")));
  const std::int64_t huge = std::int64_t{1} << 40;
  EXPECT_THAT(backend->Allocate(DType::kF32, {huge, huge}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST(Tensor, MovedFromTensorIsEmpty) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor a = AllocateOrFail(*backend, DType::kF32, {4});
  Tensor b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): documented state
  EXPECT_EQ(a.DebugString(), "<empty>");
  EXPECT_TRUE(b.valid());
}

TEST(Tensor, ReshapeKeepsElementCount) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor t = Upload(*backend, std::vector<float>{1, 2, 3, 4, 5, 6}, DType::kF32, {2, 3});
  NQ_ASSERT_OK(t.Reshape({3, 2}));
  EXPECT_EQ(t.shape(), Shape({3, 2}));
  EXPECT_THAT(Download(*backend, t), ElementsAre(1, 2, 3, 4, 5, 6));
  EXPECT_THAT(t.Reshape({4, 2}), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("F32[3, 2] has 6 elements, [4, 2] has 8")));
}

TEST(GrownCapacity, DoublesSmallBlocksAndCapsTheSlackOfLargeOnes) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  EXPECT_EQ(GrownCapacity(10, 0), 10u) << "the first block is the need";
  EXPECT_EQ(GrownCapacity(5, 8), 8u) << "held already";
  EXPECT_EQ(GrownCapacity(9, 8), 16u) << "one byte more doubles";
  EXPECT_EQ(GrownCapacity(40, 8), 40u) << "a need past twice the block is the block";
  EXPECT_EQ(GrownCapacity(600 * kMiB, 512 * kMiB), 600 * kMiB + kMaxGrowthSlack) << "large blocks grow by the slack";
  EXPECT_EQ(GrownCapacity(300 * kMiB, 200 * kMiB), 400 * kMiB);
}

TEST(Copies, RejectWrongByteCounts) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor t = AllocateOrFail(*backend, DType::kF32, {4});
  std::vector<std::byte> bytes(12);
  EXPECT_THAT(backend->CopyFromHost(bytes, t),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CopyFromHost: 12 bytes given for F32[4] (16 bytes)")));
  EXPECT_THAT(backend->CopyToHost(t, bytes),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CopyToHost: 12 bytes of room for F32[4] (16 bytes)")));
}

// A record written into a byte range of a larger tensor (a prefill's expert slot in room the
// free KV cache lends): the range changes, every byte around it stays.
TEST(Copies, CopyFromHostAtWritesOnlyItsRange) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor t = Upload(*backend, std::vector<float>(8, 1.5f), DType::kF32, {2, 4});
  const std::vector<float> record = {7, 8, 9};
  NQ_ASSERT_OK(backend->CopyFromHostAt(std::as_bytes(std::span<const float>(record)), t, 3 * sizeof(float)));
  EXPECT_THAT(Download(*backend, t), ElementsAre(1.5f, 1.5f, 1.5f, 7, 8, 9, 1.5f, 1.5f));
  // Up to the last byte, and nothing at the very end.
  NQ_ASSERT_OK(backend->CopyFromHostAt(std::as_bytes(std::span<const float>(record).first(1)), t, 7 * sizeof(float)));
  NQ_ASSERT_OK(backend->CopyFromHostAt({}, t, t.nbytes()));
  EXPECT_THAT(Download(*backend, t), ElementsAre(1.5f, 1.5f, 1.5f, 7, 8, 9, 1.5f, 7));
}

TEST(Copies, CopyFromHostAtRefusesARangePastTheTensor) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor t = Upload(*backend, std::vector<float>(4, 0.0f), DType::kF32, {4});
  std::vector<std::byte> bytes(8);
  EXPECT_THAT(backend->CopyFromHostAt(bytes, t, 9),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CopyFromHostAt: 8 bytes at offset 9 do not fit in F32[4] (16 bytes)")));
  EXPECT_THAT(backend->CopyFromHostAt({}, t, 17), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("offset 17")));
  // An offset near SIZE_MAX cannot wrap the sum around into range.
  EXPECT_THAT(backend->CopyFromHostAt(bytes, t, std::numeric_limits<std::size_t>::max() - 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
  EXPECT_THAT(Download(*backend, t), ElementsAre(0, 0, 0, 0)) << "a refused copy writes nothing";
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor theirs = AllocateOrFail(*other, DType::kF32, {4});
  EXPECT_THAT(backend->CopyFromHostAt(bytes, theirs, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dst F32[4] belongs to another backend")));
}

TEST(Copies, DeviceCopyNeedsMatchingTensors) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  Tensor src = Upload(*backend, std::vector<float>{1, 2, 3}, DType::kF32, {3});
  Tensor dst = AllocateOrFail(*backend, DType::kF32, {3});
  NQ_ASSERT_OK(backend->Copy(src, dst));
  EXPECT_THAT(Download(*backend, dst), ElementsAre(1, 2, 3));
  Tensor other = AllocateOrFail(*backend, DType::kBF16, {3});
  EXPECT_THAT(backend->Copy(src, other),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Copy: src F32[3] and dst BF16[3] differ")));
}

TEST(Copies, RejectTensorOfAnotherBackend) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor t = AllocateOrFail(*other, DType::kF32, {2});
  std::vector<std::byte> bytes(8);
  EXPECT_THAT(backend->CopyFromHost(bytes, t),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dst F32[2] belongs to another backend")));
}

TEST(TensorIo, UploadRejectsWrongValueCount) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  EXPECT_THAT(UploadFloats(*backend, std::vector<float>(5), DType::kF32, {2, 3}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("5 values for shape [2, 3] (6 elements)")));
}

TEST(TensorIo, SixteenBitRoundTripsRepresentableValues) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<float> values = {0.0f, -1.5f, 3.0f, 0.0078125f, -256.0f};
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    Tensor t = Upload(*backend, values, dtype, {5});
    EXPECT_EQ(t.nbytes(), 10u);
    EXPECT_EQ(Download(*backend, t), values) << DTypeName(dtype);
  }
}

TEST(TensorIo, Int32TensorsRoundTripAndAreNotFloats) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<std::int32_t> values = {-1, 0, 7, 2147483647};
  absl::StatusOr<Tensor> t = UploadInt32s(*backend, values, {2, 2});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kI32);
  EXPECT_EQ(t->nbytes(), 16u);
  absl::StatusOr<std::vector<std::int32_t>> back = DownloadInt32s(*backend, *t);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, values);
  EXPECT_THAT(DownloadFloats(*backend, *t).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("DownloadFloats: I32[2, 2] is not a float tensor")));
  EXPECT_THAT(UploadFloats(*backend, std::vector<float>(4), DType::kI32, {4}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("UploadFloats: I32 is not a float dtype")));
  EXPECT_THAT(DownloadInt32s(*backend, Upload(*backend, std::vector<float>(2), DType::kF32, {2}))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("DownloadInt32s: F32[2] is not an I32 tensor")));
  EXPECT_THAT(UploadInt32s(*backend, values, {5}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("UploadInt32s: 4 values for shape [5] (5 elements)")));
  EXPECT_FALSE(IsFloatDType(DType::kI32));
  EXPECT_TRUE(IsFloatDType(DType::kBF16));
}

TEST(DTypeConversion, E4M3IsAOneByteScaledFormat) {
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_STREQ(DTypeName(DType::kF8E4M3), "F8_E4M3");  // the safetensors name
  // Not widened by ops on their own: its values need the block scales.
  EXPECT_FALSE(IsFloatDType(DType::kF8E4M3));
  // Sign of zero, the largest normal, the smallest normal and subnormal, both NaNs.
  EXPECT_TRUE(std::signbit(ToFloat(F8E4M3{0x80})));
  EXPECT_EQ(ToFloat(F8E4M3{0x7e}), 448.0f);
  EXPECT_EQ(ToFloat(F8E4M3{0x08}), 0x1p-6f);
  EXPECT_EQ(ToFloat(F8E4M3{0x87}), -7 * 0x1p-9f);
  EXPECT_TRUE(std::isnan(ToFloat(F8E4M3{0x7f})));
  EXPECT_TRUE(std::isnan(ToFloat(F8E4M3{0xff})));
}

TEST(DTypeConversion, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
  EXPECT_EQ(ToBf16(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(ToBf16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  EXPECT_EQ(ToFloat(Bf16{0xbfc0}), -1.5f);
  EXPECT_TRUE(std::isnan(ToFloat(ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(ToFloat(ToBf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
}

TEST(DTypeConversion, F16HandlesSubnormalsOverflowAndTies) {
  EXPECT_EQ(ToF16(1.0f).bits, 0x3c00);
  EXPECT_EQ(ToF16(-2.0f).bits, 0xc000);
  EXPECT_EQ(ToF16(65504.0f).bits, 0x7bff);                 // largest finite
  EXPECT_EQ(ToF16(65520.0f).bits, 0x7c00);                 // rounds up to inf
  EXPECT_EQ(ToF16(0x1p-24f).bits, 0x0001);                 // smallest subnormal
  EXPECT_EQ(ToF16(0x1p-25f).bits, 0x0000);                 // tie to even: zero
  EXPECT_EQ(ToF16(1.0f + 0x1p-11f).bits, 0x3c00);          // tie to even
  EXPECT_EQ(ToFloat(F16{0x0001}), 0x1p-24f);
  EXPECT_EQ(ToFloat(F16{0x8400}), -0x1p-14f);
  EXPECT_EQ(ToFloat(F16{0x7c00}), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(ToFloat(F16{0x7e00})));
  EXPECT_TRUE(std::isnan(ToFloat(ToF16(std::numeric_limits<float>::quiet_NaN()))));
  // Every finite f16 survives f16 -> f32 -> f16.
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00) continue;  // inf / NaN
    ASSERT_EQ(ToF16(ToFloat(F16{static_cast<std::uint16_t>(bits)})).bits, bits) << bits;
  }
}

}  // namespace
}  // namespace nq::kernels
