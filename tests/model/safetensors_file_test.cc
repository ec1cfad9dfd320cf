// SafetensorsWriter -> SafetensorsFile round trips, layout, and file-level errors.
#include "services/model/safetensors.h"

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/model/dtype_convert.h"
#include "services/model/safetensors_writer.h"
#include "tests/common/status_matchers.h"
#include "tests/model/safetensors_test_util.h"

namespace nq::model {
namespace {

using ::nq::model::testing::ReadFile;
using ::nq::model::testing::TempDirTest;
using ::nq::model::testing::WriteFile;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::vector<std::byte> Bytes(std::span<const std::byte> span) {
  return std::vector<std::byte>(span.begin(), span.end());
}

std::vector<float> Ramp(size_t n, float step = 0.25f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (static_cast<float>(i) - n / 2.0f) * step;
  return v;
}

// A writer with one tensor of each kind and sizes that are not multiples of 8.
SafetensorsWriter MakeWriter() {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  EXPECT_THAT(writer.AddFloat32("f32", {2, 3}, Ramp(6)), IsOk());
  EXPECT_THAT(writer.AddFloat32("bf16", {3}, Ramp(3), DType::kBF16), IsOk());
  EXPECT_THAT(writer.AddFloat32("f16", {5}, Ramp(5), DType::kF16), IsOk());
  EXPECT_THAT(writer.AddFloat32("fp8", {7}, Ramp(7), DType::kF8E4M3), IsOk());
  EXPECT_THAT(writer.AddFp8BlockQuantized("w.weight", 130, 3, Ramp(390, 0.01f)), IsOk());
  EXPECT_THAT(writer.Add("ids", DType::kI64, {2}, std::vector<std::byte>(16, std::byte{1})),
              IsOk());
  EXPECT_THAT(writer.Add("empty", DType::kF32, {0, 4}, {}), IsOk());
  return writer;
}

class SafetensorsFileTest : public TempDirTest {};

TEST_F(SafetensorsFileTest, RoundTripsEveryTensor) {
  const SafetensorsWriter writer = MakeWriter();
  ASSERT_THAT(writer.Write(Path("m.safetensors")), IsOk());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(Path("m.safetensors"));
  ASSERT_THAT(file, IsOk());
  EXPECT_THAT(file->Names(), ElementsAre("bf16", "empty", "f16", "f32", "fp8", "ids", "w.weight",
                                         "w.weight_scale_inv"));
  EXPECT_EQ(file->header().metadata.at("format"), "pt");

  absl::StatusOr<TensorView> f32 = file->Find("f32");
  ASSERT_THAT(f32, IsOk());
  EXPECT_EQ(f32->name, "f32");
  EXPECT_EQ(f32->dtype, DType::kF32);
  EXPECT_THAT(f32->shape, ElementsAre(2, 3));
  EXPECT_EQ(*ConvertToFloat32(f32->dtype, f32->data), Ramp(6));

  absl::StatusOr<TensorView> bf16 = file->Find("bf16");
  ASSERT_THAT(bf16, IsOk());
  EXPECT_EQ(bf16->dtype, DType::kBF16);
  EXPECT_EQ(Bytes(bf16->data), *ConvertFromFloat32(Ramp(3), DType::kBF16));

  absl::StatusOr<TensorView> weight = file->Find("w.weight");
  absl::StatusOr<TensorView> scale = file->Find("w.weight_scale_inv");
  ASSERT_THAT(weight, IsOk());
  ASSERT_THAT(scale, IsOk());
  EXPECT_EQ(weight->dtype, DType::kF8E4M3);
  EXPECT_THAT(weight->shape, ElementsAre(130, 3));
  EXPECT_EQ(scale->dtype, DType::kF32);
  EXPECT_THAT(scale->shape, ElementsAre(2, 1));
  absl::StatusOr<Fp8BlockQuantized> q = QuantizeFp8Block(Ramp(390, 0.01f), 130, 3);
  ASSERT_THAT(q, IsOk());
  EXPECT_EQ(Bytes(weight->data), q->codes);
  EXPECT_EQ(*ConvertToFloat32(DType::kF32, scale->data), q->scale_inv);

  absl::StatusOr<TensorView> empty = file->Find("empty");
  ASSERT_THAT(empty, IsOk());
  EXPECT_EQ(empty->numel(), 0u);
  EXPECT_TRUE(empty->data.empty());
}

TEST_F(SafetensorsFileTest, SerializeMatchesTheWrittenFile) {
  const SafetensorsWriter writer = MakeWriter();
  ASSERT_THAT(writer.Write(Path("m.safetensors")), IsOk());
  absl::StatusOr<std::string> bytes = writer.Serialize();
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(*bytes, ReadFile(Path("m.safetensors")));
  EXPECT_THAT(ParseSafetensorsHeader(*bytes, bytes->size()), IsOk());
}

TEST_F(SafetensorsFileTest, LayoutIsAlignedAndGapFree) {
  absl::StatusOr<std::string> bytes = MakeWriter().Serialize();
  ASSERT_THAT(bytes, IsOk());
  absl::StatusOr<Header> header = ParseSafetensorsHeader(*bytes, bytes->size());
  ASSERT_THAT(header, IsOk());
  EXPECT_EQ(header->data_offset % 8, 0u);
  // The JSON is padded with spaces up to the data section.
  EXPECT_EQ((*bytes)[header->data_offset - 1], ' ');
  for (const TensorInfo& t : header->tensors) {
    EXPECT_EQ(t.begin % DTypeSize(t.dtype), 0u) << t.name;
    if (t.byte_size() % 8 == 0) {
      EXPECT_EQ(t.begin % 8, 0u) << t.name;
    }
  }
}

TEST_F(SafetensorsFileTest, WriteLeavesNoTemporaryFiles) {
  ASSERT_THAT(MakeWriter().Write(Path("m.safetensors")), IsOk());
  ASSERT_THAT(MakeWriter().Write(Path("m.safetensors")), IsOk());  // replaces it
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_THAT(names, ElementsAre("m.safetensors"));
}

TEST_F(SafetensorsFileTest, ViewsSurviveMovingTheFile) {
  ASSERT_THAT(MakeWriter().Write(Path("m.safetensors")), IsOk());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(Path("m.safetensors"));
  ASSERT_THAT(file, IsOk());
  const TensorView view = *file->Find("f32");
  SafetensorsFile moved = *std::move(file);
  EXPECT_EQ(view.name, "f32");
  EXPECT_EQ(*ConvertToFloat32(view.dtype, view.data), Ramp(6));
  EXPECT_THAT(moved.Prefetch(view), IsOk());
}

TEST_F(SafetensorsFileTest, MissingTensorIsNotFound) {
  ASSERT_THAT(MakeWriter().Write(Path("m.safetensors")), IsOk());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(Path("m.safetensors"));
  ASSERT_THAT(file, IsOk());
  EXPECT_THAT(file->Find("nope"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("tensor 'nope' not found in safetensors file"),
                             HasSubstr("m.safetensors"))));
}

TEST_F(SafetensorsFileTest, MissingFileIsNotFound) {
  EXPECT_THAT(SafetensorsFile::Open(Path("absent.safetensors")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("absent.safetensors")));
  EXPECT_THAT(SafetensorsFile::Open(dir()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a regular file")));
}

TEST_F(SafetensorsFileTest, TruncatedFileIsDataLossNamingTheFile) {
  absl::StatusOr<std::string> bytes = MakeWriter().Serialize();
  ASSERT_THAT(bytes, IsOk());
  WriteFile(Path("cut.safetensors"), bytes->substr(0, bytes->size() - 3));
  EXPECT_THAT(SafetensorsFile::Open(Path("cut.safetensors")),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("safetensors file " + Path("cut.safetensors") + ": tensor"),
                             HasSubstr("end past the data section"))));
  WriteFile(Path("head.safetensors"), bytes->substr(0, 20));
  EXPECT_THAT(SafetensorsFile::Open(Path("head.safetensors")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("runs past the end of the file")));
  WriteFile(Path("tiny.safetensors"), bytes->substr(0, 5));
  EXPECT_THAT(SafetensorsFile::Open(Path("tiny.safetensors")),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("tiny.safetensors"), HasSubstr("file holds 5 bytes"))));
  WriteFile(Path("zero.safetensors"), "");
  EXPECT_THAT(SafetensorsFile::Open(Path("zero.safetensors")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("file holds 0 bytes")));
}

TEST(SafetensorsWriterTest, RejectsBadTensors) {
  SafetensorsWriter writer;
  ASSERT_THAT(writer.AddFloat32("a", {2}, std::vector<float>{1, 2}), IsOk());
  EXPECT_THAT(writer.AddFloat32("a", {2}, std::vector<float>{1, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'a' added twice")));
  EXPECT_THAT(writer.Add("b", DType::kF32, {3}, std::vector<std::byte>(8)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'b': F32 of 3 elements needs 12 bytes, got 8")));
  EXPECT_THAT(writer.Add("c", DType::kU8, {-1}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative dim -1")));
  EXPECT_THAT(writer.Add("__metadata__", DType::kU8, {0}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty or reserved")));
  EXPECT_THAT(writer.AddFloat32("d", {1}, std::vector<float>{1}, DType::kI32),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'd': cannot convert F32 to I32")));
  EXPECT_THAT(writer.AddFp8BlockQuantized("e", 2, 2, std::vector<float>{1, 2, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'e': FP8 block")));
  EXPECT_THAT(writer.AddFloat32("a_scale_inv", {1}, std::vector<float>{1}), IsOk());
  EXPECT_THAT(writer.AddFp8BlockQuantized("a", 1, 1, std::vector<float>{1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("added twice")));
  EXPECT_THAT(writer.Add("\xff", DType::kU8, {0}, {}), IsOk());
  EXPECT_THAT(writer.Serialize(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot write the header")));
}

}  // namespace
}  // namespace nq::model
