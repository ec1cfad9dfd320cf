// ParseSafetensorsHeader: one test per validation rule, each checking the precise error.
#include "services/model/safetensors_header.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"
#include "tests/model/safetensors_test_util.h"

namespace nq::model {
namespace {

using ::nq::model::testing::Entry;
using ::nq::model::testing::MakeFile;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<Header> Parse(const std::string& file) {
  return ParseSafetensorsHeader(file, file.size());
}

TEST(SafetensorsHeaderTest, ParsesTensorsAndMetadata) {
  const std::string header = "{\"__metadata__\":{\"format\":\"pt\"}," +
                             Entry("b", "BF16", "[2,3]", 8, 20) + "," +
                             Entry("a", "F32", "[2]", 0, 8) + "}";
  absl::StatusOr<Header> parsed = Parse(MakeFile(header, 20));
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->header_bytes, header.size());
  EXPECT_EQ(parsed->data_offset, 8 + header.size());
  EXPECT_EQ(parsed->data_bytes, 20u);
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
  ASSERT_EQ(parsed->tensors.size(), 2u);  // sorted by name
  EXPECT_EQ(parsed->tensors[0].name, "a");
  EXPECT_EQ(parsed->tensors[0].dtype, DType::kF32);
  EXPECT_THAT(parsed->tensors[0].shape, ElementsAre(2));
  EXPECT_EQ(parsed->tensors[1].name, "b");
  EXPECT_EQ(parsed->tensors[1].dtype, DType::kBF16);
  EXPECT_THAT(parsed->tensors[1].shape, ElementsAre(2, 3));
  EXPECT_EQ(parsed->tensors[1].begin, 8u);
  EXPECT_EQ(parsed->tensors[1].end, 20u);
  EXPECT_EQ(parsed->tensors[1].numel(), 6u);
  EXPECT_EQ(parsed->Find("b"), &parsed->tensors[1]);
  EXPECT_EQ(parsed->Find("c"), nullptr);
}

TEST(SafetensorsHeaderTest, AcceptsEmptyHeaderScalarsEmptyTensorsAndPadding) {
  EXPECT_THAT(Parse(MakeFile("{}")), IsOk());
  // A scalar (shape []), an empty tensor at offset 0 and one at the end, space padding.
  const std::string header = "{" + Entry("s", "F32", "[]", 0, 4) + "," +
                             Entry("e0", "F16", "[0,5]", 0, 0) + "," +
                             Entry("e1", "I8", "[3,0]", 4, 4) + "}    ";
  absl::StatusOr<Header> parsed = Parse(MakeFile(header, 4));
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->Find("s")->numel(), 1u);
  EXPECT_EQ(parsed->Find("e0")->numel(), 0u);
}

TEST(SafetensorsHeaderTest, RecognisesEveryDType) {
  for (const char* name : {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16",
                           "I8", "U64", "U32", "U16", "U8", "BOOL"}) {
    absl::StatusOr<DType> dtype = ParseDType(name);
    ASSERT_THAT(dtype, IsOk()) << name;
    EXPECT_EQ(DTypeName(*dtype), name);
    const std::string header = "{" + Entry("t", name, "[3]", 0, 3 * DTypeSize(*dtype)) + "}";
    EXPECT_THAT(Parse(MakeFile(header, 3 * DTypeSize(*dtype))), IsOk()) << name;
  }
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
}

TEST(SafetensorsHeaderTest, FileShorterThanLengthPrefixIsDataLoss) {
  EXPECT_THAT(Parse(std::string("\x02\x00\x00", 3)),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("file holds 3 bytes, fewer than the 8-byte header length")));
  EXPECT_THAT(Parse(""), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("file holds 0 bytes")));
}

TEST(SafetensorsHeaderTest, HeaderLengthBeyondFileIsDataLoss) {
  std::string file = MakeFile("{}");
  file.pop_back();  // the length says 2, one byte is left
  EXPECT_THAT(Parse(file), StatusIs(absl::StatusCode::kDataLoss,
                                    HasSubstr("header length 2 runs past the end of the file "
                                              "(9 bytes): truncated file")));
}

TEST(SafetensorsHeaderTest, HeaderLengthOverLimitIsInvalid) {
  std::string file(16, '\0');
  const uint64_t n = kMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>(n >> (8 * i));
  EXPECT_THAT(ParseSafetensorsHeader(file, uint64_t{1} << 40),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("header length 100000001 exceeds the limit of 100000000 bytes")));
}

TEST(SafetensorsHeaderTest, PrefixShorterThanHeaderIsCallerError) {
  const std::string file = MakeFile("{}");
  EXPECT_THAT(ParseSafetensorsHeader(file.substr(0, 9), 100),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("given 9 bytes, but the header ends at byte 10")));
  // A prefix holding the whole header is enough.
  const std::string header_only = MakeFile("{" + Entry("a", "U8", "[4]", 0, 4) + "}");
  EXPECT_THAT(ParseSafetensorsHeader(header_only, header_only.size() + 4), IsOk());
}

TEST(SafetensorsHeaderTest, MalformedJsonIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{\"a\":")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("header JSON: "), HasSubstr("parse error at line 1, column 6"))));
  EXPECT_THAT(Parse(MakeFile("{} x")), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("expected end of input")));
  EXPECT_THAT(Parse(MakeFile("{\"\xff\":1}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ill-formed UTF-8")));
}

TEST(SafetensorsHeaderTest, HeaderMustBeAnObject) {
  EXPECT_THAT(Parse(MakeFile("[]")), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("header JSON must start with '{'")));
  EXPECT_THAT(Parse(MakeFile(" {}")), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("must start with '{'")));
  EXPECT_THAT(Parse(MakeFile("")), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("must start with '{'")));
}

TEST(SafetensorsHeaderTest, DeepNestingIsInvalid) {
  const std::string deep = "{\"a\":" + std::string(100, '[') + std::string(100, ']') + "}";
  EXPECT_THAT(Parse(MakeFile(deep)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("JSON nests deeper than 32 levels at '/a/0/0/0")));
}

TEST(SafetensorsHeaderTest, DuplicateTensorNameIsInvalid) {
  const std::string header =
      "{" + Entry("a", "U8", "[4]", 0, 4) + "," + Entry("a", "U8", "[4]", 4, 8) + "}";
  EXPECT_THAT(Parse(MakeFile(header, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("header JSON: duplicate key 'a' in the top-level object")));
}

TEST(SafetensorsHeaderTest, DuplicateFieldIsInvalid) {
  const std::string header =
      "{\"a\":{\"dtype\":\"U8\",\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,4]}}";
  EXPECT_THAT(Parse(MakeFile(header, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("duplicate key 'dtype' in the object at '/a'")));
}

TEST(SafetensorsHeaderTest, BadMetadataIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{\"__metadata__\":{\"format\":1}}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"__metadata__\" value for key 'format' must be a string, got "
                                 "a JSON number")));
  EXPECT_THAT(Parse(MakeFile("{\"__metadata__\":[]}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"__metadata__\" must be an object of strings, got a JSON array")));
}

TEST(SafetensorsHeaderTest, MalformedEntryIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{\"a\":7}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'a': entry must be a JSON object")));
  EXPECT_THAT(Parse(MakeFile("{\"a\":{\"dtype\":\"U8\",\"shape\":[0]}}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'a': missing \"data_offsets\"")));
  EXPECT_THAT(Parse(MakeFile("{\"a\":{\"dtype\":8,\"shape\":[0],\"data_offsets\":[0,0]}}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'a': \"dtype\" must be a string, got a JSON number")));
  EXPECT_THAT(Parse(MakeFile("{\"a\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,3]}}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'a': \"shape\" must be an array, got a JSON number")));
  EXPECT_THAT(Parse(MakeFile("{\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0]}}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'a': \"data_offsets\" must be an array [begin, end]")));
}

TEST(SafetensorsHeaderTest, UnknownDTypeIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "F7", "[1]", 0, 1) + "}", 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': unknown dtype 'F7'")));
}

TEST(SafetensorsHeaderTest, NegativeOrNonIntegerShapeIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[2,-2]", 0, 4) + "}", 4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': shape[1] is negative (-2)")));
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[1.5]", 0, 1) + "}", 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': shape[0] must be a non-negative integer, got the "
                                 "number 1.5")));
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[\"4\"]", 0, 4) + "}", 4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shape[0] must be a non-negative integer, got a JSON string")));
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[9223372036854775808]", 0, 4) + "}", 4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shape[0] (9223372036854775808) exceeds 2^63 - 1")));
}

TEST(SafetensorsHeaderTest, OverflowingShapeIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "F32", "[4294967296,4294967296]", 0, 0) + "}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': shape [4294967296, 4294967296] of F32 has a byte "
                                 "size that overflows 64 bits")));
  // The element count fits; the byte count does not.
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "F64", "[2305843009213693952]", 0, 0) + "}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows 64 bits")));
  // As in the reference implementation the running product is checked, so dims that
  // overflow before a later 0 are refused too.
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[4294967296,4294967296,0]", 0, 0) + "}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows 64 bits")));
}

TEST(SafetensorsHeaderTest, WrongByteLengthIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "F32", "[2]", 0, 6) + "}", 6)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': data_offsets [0, 6] span 6 bytes, but F32 with "
                                 "shape [2] needs 8")));
}

TEST(SafetensorsHeaderTest, ReversedOffsetsAreInvalid) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[0]", 4, 0) + "}", 4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': data_offsets [4, 0] end before they begin")));
  EXPECT_THAT(Parse(MakeFile("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[-1,0]}}")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'w': data_offsets[0] is negative (-1)")));
}

TEST(SafetensorsHeaderTest, OffsetsPastDataSectionAreDataLoss) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "F32", "[4]", 0, 16) + "}", 12)),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("tensor 'w': data_offsets [0, 16] end past the data section "
                                 "(12 bytes): the file is truncated or the offsets are wrong")));
  EXPECT_THAT(Parse(MakeFile("{" + Entry("w", "U8", "[1]", 18446744073709551614ull,
                                         18446744073709551615ull) +
                             "}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds 2^63 - 1")));
}

TEST(SafetensorsHeaderTest, OverlapIsInvalid) {
  const std::string header =
      "{" + Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "F32", "[2]", 4, 12) + "}";
  EXPECT_THAT(Parse(MakeFile(header, 12)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensors 'a' [0, 8) and 'b' [4, 12) overlap in the data section")));
  // Identical ranges overlap too.
  const std::string same =
      "{" + Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "I32", "[2]", 0, 8) + "}";
  EXPECT_THAT(Parse(MakeFile(same, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
}

TEST(SafetensorsHeaderTest, GapIsInvalid) {
  const std::string header =
      "{" + Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "F32", "[2]", 16, 24) + "}";
  EXPECT_THAT(Parse(MakeFile(header, 24)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gap in the data section: bytes [8, 16) before tensor 'b' "
                                 "belong to no tensor")));
  EXPECT_THAT(Parse(MakeFile("{" + Entry("a", "U8", "[2]", 2, 4) + "}", 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes [0, 2) before")));
}

TEST(SafetensorsHeaderTest, UncoveredTailIsInvalid) {
  EXPECT_THAT(Parse(MakeFile("{" + Entry("a", "F32", "[2]", 0, 8) + "}", 11)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the data section holds 11 bytes but its tensors cover only "
                                 "[0, 8): bytes [8, 11) belong to no tensor")));
  EXPECT_THAT(Parse(MakeFile("{}", 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes [0, 1)")));
}

TEST(SafetensorsHeaderTest, LongNamesAreCutInMessages) {
  const std::string name(100000, 'x');
  absl::StatusOr<Header> parsed = Parse(MakeFile("{" + Entry(name, "F7", "[1]", 0, 1) + "}", 1));
  ASSERT_FALSE(parsed.ok());
  EXPECT_LT(parsed.status().message().size(), 400u);
  EXPECT_THAT(parsed, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(100000 bytes)")));
  // A malformed long token: nlohmann's message quotes it, ours is cut.
  parsed = Parse(MakeFile("{\"" + name + "\x01\":1}"));
  ASSERT_FALSE(parsed.ok());
  EXPECT_LT(parsed.status().message().size(), 500u);
  EXPECT_THAT(parsed, StatusIs(absl::StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("parse error"), HasSubstr("... (cut)"))));
}

}  // namespace
}  // namespace nq::model
