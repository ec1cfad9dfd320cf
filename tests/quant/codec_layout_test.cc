// Plane byte layout and the codec registry.
#include "services/quant/codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/quant/nested_scalar_codec.h"
#include "tests/common/status_matchers.h"

namespace nq::quant {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::Contains;
using ::testing::HasSubstr;

TEST(PlaneLayoutTest, TwoBitCodesPackLittleEndianWithinByte) {
  const std::vector<uint8_t> codes = {1, 2, 3, 0, 3};
  const std::vector<uint8_t> plane = PackCodes(codes, 2);
  ASSERT_EQ(plane.size(), 2u);
  EXPECT_EQ(plane[0], 0x39);  // 0b00'11'10'01
  EXPECT_EQ(plane[1], 0x03);  // partial byte zero-padded
  for (size_t k = 0; k < codes.size(); ++k) EXPECT_EQ(UnpackCode(plane, k, 2), codes[k]);
}

TEST(PlaneLayoutTest, RoundTripsAtEveryWidth) {
  for (int bits : {1, 2, 4, 8}) {
    std::vector<uint8_t> codes(1001);
    for (size_t k = 0; k < codes.size(); ++k) codes[k] = static_cast<uint8_t>((k * 37 + 5) % (1 << bits));
    const std::vector<uint8_t> plane = PackCodes(codes, bits);
    EXPECT_EQ(static_cast<int64_t>(plane.size()), PlaneBytes(1, 1001, bits));
    for (size_t k = 0; k < codes.size(); ++k) ASSERT_EQ(UnpackCode(plane, k, bits), codes[k]);
  }
}

TEST(PlaneLayoutTest, PlaneBytes) {
  EXPECT_EQ(PlaneBytes(2048, 6144, 2), 2048 * 6144 / 4);
  EXPECT_EQ(PlaneBytes(1, 5, 2), 2);
  EncodedMatrix m;
  m.rows = 256;
  m.cols = 512;
  EXPECT_EQ(BasePlaneBytes(m), 256 * 512 / 4);
  EXPECT_EQ(ResidualPlaneBytes(m), 256 * 512 / 4);
}

TEST(PlaneLayoutTest, AttachResidualChecksSize) {
  EncodedMatrix m;
  m.rows = 128;
  m.cols = 128;
  EXPECT_THAT(AttachResidual(m, std::vector<uint8_t>(100)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 4096")));
  EXPECT_FALSE(m.has_residual());
  EXPECT_THAT(AttachResidual(m, std::vector<uint8_t>(4096)), IsOk());
  EXPECT_TRUE(m.has_residual());
  DropResidual(m);
  EXPECT_FALSE(m.has_residual());
}

TEST(CodecRegistryTest, NestedScalarIsBuiltIn) {
  EXPECT_THAT(RegisteredCodecNames(), Contains("nested_scalar_v1"));
  auto codec = MakeCodec("nested_scalar_v1");
  ASSERT_THAT(codec, IsOk());
  EXPECT_EQ((*codec)->name(), "nested_scalar_v1");
}

TEST(CodecRegistryTest, UnknownNameListsKnownCodecs) {
  EXPECT_THAT(MakeCodec("trellis_v9"), StatusIs(absl::StatusCode::kNotFound,
                                                HasSubstr("known: nested_scalar_v1")));
}

TEST(CodecRegistryTest, RegistersNewCodecsOnce) {
  auto factory = [] { return std::make_unique<NestedScalarCodec>(); };
  EXPECT_THAT(RegisterCodec("registry_test_codec", factory), IsOk());
  EXPECT_THAT(MakeCodec("registry_test_codec"), IsOk());
  EXPECT_THAT(RegisterCodec("registry_test_codec", factory),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("registry_test_codec")));
  EXPECT_THAT(RegisterCodec("nested_scalar_v1", factory),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already registered")));
}

}  // namespace
}  // namespace nq::quant
