// json.dumps / repr(float) / str.strip as the templates' Python side computes them.
#include "services/chat/py_text.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "tests/common/status_matchers.h"

namespace nq::chat {
namespace {

using ::nq::testing::StatusIs;
using ::testing::ElementsAre;

TEST(PyFloatReprTest, MatchesPythonRepr) {
  // Expected values are Python 3's repr().
  EXPECT_EQ(PyFloatRepr(0.0), "0.0");
  EXPECT_EQ(PyFloatRepr(-0.0), "-0.0");
  EXPECT_EQ(PyFloatRepr(1.0), "1.0");
  EXPECT_EQ(PyFloatRepr(1.5), "1.5");
  EXPECT_EQ(PyFloatRepr(0.1), "0.1");
  EXPECT_EQ(PyFloatRepr(100.0), "100.0");
  EXPECT_EQ(PyFloatRepr(0.0001), "0.0001");
  EXPECT_EQ(PyFloatRepr(0.00001), "1e-05");
  EXPECT_EQ(PyFloatRepr(1e-7), "1e-07");
  EXPECT_EQ(PyFloatRepr(1e15), "1000000000000000.0");
  EXPECT_EQ(PyFloatRepr(1e16), "1e+16");
  EXPECT_EQ(PyFloatRepr(1.5e16), "1.5e+16");
  EXPECT_EQ(PyFloatRepr(123456789.125), "123456789.125");
  EXPECT_EQ(PyFloatRepr(-2.5e-5), "-2.5e-05");
  EXPECT_EQ(PyFloatRepr(1e300), "1e+300");
  EXPECT_EQ(PyFloatRepr(std::numeric_limits<double>::denorm_min()), "5e-324");
  EXPECT_EQ(PyFloatRepr(12345678901234567.0), "1.2345678901234568e+16");
  EXPECT_EQ(PyFloatRepr(0.3), "0.3");
  EXPECT_EQ(PyFloatRepr(2.0 / 3.0), "0.6666666666666666");
}

TEST(PyJsonDumpsTest, SeparatorsAndKeyOrder) {
  const Json v = *ParseJson(R"({"b": 1, "a": [1, 2.0, true, false, null], "c": {}, "d": []})");
  EXPECT_EQ(PyJsonDumps(v), R"({"b": 1, "a": [1, 2.0, true, false, null], "c": {}, "d": []})");
}

TEST(PyJsonDumpsTest, StringEscapesLikeEnsureAsciiFalse) {
  const Json v = std::string("q\" b\\ \n\r\t\b\f \x01\x1f\x7f é 北京 😀");
  EXPECT_EQ(PyJsonDumps(v), "\"q\\\" b\\\\ \\n\\r\\t\\b\\f \\u0001\\u001f\x7f é 北京 😀\"");
}

TEST(PyJsonDumpsTest, UnicodeEscapesInInputBecomeRawText) {
  EXPECT_EQ(PyJsonDumps(*ParseJson(R"("\u00e9\ud83d\ude00\u0000")")), "\"é😀\\u0000\"");
}

TEST(PyJsonDumpsTest, RepeatedKeyKeepsFirstPositionLastValue) {
  EXPECT_EQ(PyJsonDumps(*ParseJson(R"({"a": 1, "b": 2, "a": 3})")), R"({"a": 3, "b": 2})");
}

TEST(PyJsonDumpsTest, Numbers) {
  EXPECT_EQ(PyJsonDumps(*ParseJson("[1E2, -0, -0.0, 12345678901234567, 1e16, -7]")),
            "[100.0, 0, -0.0, 12345678901234567, 1e+16, -7]");
}

TEST(ParseJsonTest, BadJson) {
  EXPECT_THAT(ParseJson("{\"a\": }"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(ParseJson("{} trailing"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(ParseJson(""), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(PyStripTest, StripsPythonWhitespace) {
  EXPECT_EQ(PyStrip("  a b \n\t"), "a b");
  EXPECT_EQ(PyStrip("\u3000\u00a0x\u2028\u0085\x1c"), "x");
  EXPECT_EQ(PyStrip("\u200bx\u200b"), "\u200bx\u200b");  // zero-width space is not space
  EXPECT_EQ(PyStrip(" \n "), "");
  EXPECT_EQ(PyStrip(""), "");
  EXPECT_EQ(PyStrip(" 北京 "), "北京");
}

TEST(PyStripTest, CharsAndSplit) {
  EXPECT_EQ(PyLStripChars("\n\nab\n", "\n"), "ab\n");
  EXPECT_EQ(PyRStripChars("\nab\n\n", "\n"), "\nab");
  EXPECT_EQ(PyRStripChars("\n\n", "\n"), "");
  EXPECT_THAT(PySplit("a</t>b</t>", "</t>"), ElementsAre("a", "b", ""));
  EXPECT_THAT(PySplit("ab", "</t>"), ElementsAre("ab"));
}

}  // namespace
}  // namespace nq::chat
