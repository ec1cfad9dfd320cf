// The NVFP4 element codes, the nibble order and the ModelOpt tensor trio, on hand-computed
// values.
#include "services/nvfp4/nvfp4_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "services/model/safetensors_writer.h"
#include "tests/common/status_matchers.h"

namespace nq::nvfp4 {
namespace {

using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(E2M1, DecodesEveryCode) {
  const float want[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int code = 0; code < 16; ++code) EXPECT_EQ(kernels::E2M1ToFloat(code), want[code]) << code;
}

TEST(E2M1, EncodesToNearestWithTiesToEven) {
  EXPECT_EQ(FloatToE2M1(0.0f), 0);
  EXPECT_EQ(FloatToE2M1(0.25f), 0);   // tie 0 | 0.5 -> 0
  EXPECT_EQ(FloatToE2M1(0.26f), 1);
  EXPECT_EQ(FloatToE2M1(0.75f), 2);   // tie 0.5 | 1 -> 1
  EXPECT_EQ(FloatToE2M1(1.25f), 2);   // tie 1 | 1.5 -> 1
  EXPECT_EQ(FloatToE2M1(1.75f), 4);   // tie 1.5 | 2 -> 2
  EXPECT_EQ(FloatToE2M1(2.5f), 4);    // tie 2 | 3 -> 2
  EXPECT_EQ(FloatToE2M1(3.5f), 6);    // tie 3 | 4 -> 4
  EXPECT_EQ(FloatToE2M1(5.0f), 6);    // tie 4 | 6 -> 4
  EXPECT_EQ(FloatToE2M1(5.01f), 7);
  EXPECT_EQ(FloatToE2M1(100.0f), 7);  // saturates (a clip)
  EXPECT_EQ(FloatToE2M1(-3.0f), 13);
  EXPECT_EQ(FloatToE2M1(-0.1f), 8);   // -0 keeps its sign bit, as ModelOpt's cast does
}

TEST(Dequantize, LowNibbleIsTheEvenElement) {
  // One row of 16: byte 0 = 0xD7 holds element 0 = code 7 (6.0) and element 1 = code 13 (-3.0).
  std::vector<uint8_t> packed = {0xD7, 0x13, 0, 0, 0, 0, 0, 0};
  std::vector<uint8_t> scales = {0x38};  // E4M3 1.0
  Nvfp4View view{1, 16, packed, scales, 0.5f};
  absl::StatusOr<std::vector<float>> values = Dequantize(view);
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(std::vector<float>(values->begin(), values->begin() + 4), ElementsAre(3.0f, -1.5f, 0.75f, 0.25f));
}

TEST(Dequantize, AppliesBlockAndGlobalScales) {
  // Two blocks: scale codes 0x40 (2.0) and 0x30 (0.5); global 0.25. Element 0 of each = 6.
  std::vector<uint8_t> packed(16, 0);
  packed[0] = 0x07;
  packed[8] = 0x07;
  std::vector<uint8_t> scales = {0x40, 0x30};
  absl::StatusOr<std::vector<float>> values = Dequantize({1, 32, packed, scales, 0.25f});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ((*values)[0], 6.0f * 2.0f * 0.25f);
  EXPECT_EQ((*values)[16], 6.0f * 0.5f * 0.25f);
  EXPECT_EQ((*values)[1], 0.0f);
}

TEST(Dequantize, RefusesBadShapes) {
  std::vector<uint8_t> packed(8), scales(1);
  EXPECT_THAT(Dequantize({1, 24, packed, scales, 1.0f}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of 16")));
  EXPECT_THAT(Dequantize({2, 16, packed, scales, 1.0f}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("want 16 packed bytes")));
  EXPECT_THAT(Dequantize({1, 16, packed, scales, 0.0f}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global scale")));
}

std::vector<std::byte> Bytes(std::vector<uint8_t> v) {
  std::vector<std::byte> out(v.size());
  std::memcpy(out.data(), v.data(), v.size());
  return out;
}

TEST(ReadNvfp4, ChecksDtypesAndShapes) {
  const std::string dir = ::testing::TempDir() + "/nvfp4_read";
  model::SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a.weight", model::DType::kU8, {2, 8}, Bytes(std::vector<uint8_t>(16, 0x21))).ok());
  ASSERT_TRUE(writer.Add("a.weight_scale", model::DType::kF8E4M3, {2, 1}, Bytes({0x38, 0x40})).ok());
  const float two[1] = {2.0f};
  ASSERT_TRUE(writer.AddFloat32("a.weight_scale_2", {}, two).ok());
  ASSERT_TRUE(writer.Add("b.weight", model::DType::kU8, {2, 8}, Bytes(std::vector<uint8_t>(16))).ok());
  ASSERT_TRUE(writer.Add("b.weight_scale", model::DType::kF8E4M3, {2, 2}, Bytes({0, 0, 0, 0})).ok());
  ASSERT_TRUE(writer.AddFloat32("b.weight_scale_2", {}, two).ok());
  ASSERT_TRUE(writer.WriteCheckpoint(dir).ok());
  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();

  absl::StatusOr<Nvfp4View> a = ReadNvfp4(*checkpoint, "a.weight");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->rows, 2);
  EXPECT_EQ(a->cols, 16);
  EXPECT_EQ(a->scale_2, 2.0f);
  absl::StatusOr<std::vector<float>> values = Dequantize(*a);
  ASSERT_TRUE(values.ok());
  // 0x21: low nibble 1 (0.5), high nibble 2 (1.0); row 1 has block scale 2.0.
  EXPECT_EQ((*values)[0], 0.5f * 1.0f * 2.0f);
  EXPECT_EQ((*values)[17], 1.0f * 2.0f * 2.0f);

  EXPECT_THAT(ReadNvfp4(*checkpoint, "b.weight").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("b.weight_scale: want F8_E4M3 [2, 1]")));
  EXPECT_THAT(ReadNvfp4(*checkpoint, "c.weight").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("c.weight")));
}

}  // namespace
}  // namespace nq::nvfp4
