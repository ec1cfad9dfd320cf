// JavaScript regex semantics on PCRE2 (services/tokenizer/js_regex.h).
#include "services/tokenizer/js_regex.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::tokenizer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Matches(std::string_view pattern, std::string_view subject) {
  absl::StatusOr<std::unique_ptr<JsRegex>> regex = JsRegex::Compile(pattern);
  EXPECT_THAT(regex, IsOk());
  if (!regex.ok()) return {};
  std::vector<MatchSpan> spans;
  EXPECT_THAT((*regex)->FindAll(subject, &spans), IsOk());
  std::vector<std::string> out;
  for (const MatchSpan& m : spans) out.emplace_back(subject.substr(m.begin, m.end - m.begin));
  return out;
}

TEST(JsRegexTest, WhitespaceIsJavaScriptsSet) {
  // In JavaScript \s has U+FEFF but neither U+0085 (NEL) nor U+180E; PCRE2 says the opposite.
  EXPECT_THAT(Matches("\\s", "a\xEF\xBB\xBF" "b"), ElementsAre("\xEF\xBB\xBF"));
  EXPECT_THAT(Matches("\\s", "a\xC2\x85" "b\xE1\xA0\x8E" "c"), ElementsAre());
  EXPECT_THAT(Matches("\\s+", "\t\n\v\f\r \xC2\xA0\xE3\x80\x80\xE2\x80\xA8"),
              ElementsAre("\t\n\v\f\r \xC2\xA0\xE3\x80\x80\xE2\x80\xA8"));
  EXPECT_THAT(Matches("[^\\s]+", "ab\xC2\x85" "cd ef"), ElementsAre("ab\xC2\x85" "cd", "ef"));
  EXPECT_THAT(Matches("\\S+", "x\xEF\xBB\xBFy"), ElementsAre("x", "y"));
}

TEST(JsRegexTest, DotStopsAtJavaScriptLineTerminators) {
  EXPECT_THAT(Matches(".+", "ab\rcd\xE2\x80\xA8" "ef\ngh"), ElementsAre("ab", "cd", "ef", "gh"));
}

TEST(JsRegexTest, UnicodeEscapesAndProperties) {
  EXPECT_THAT(Matches("\\u00e9+", "\xC3\xA9\xC3\xA9x"), ElementsAre("\xC3\xA9\xC3\xA9"));
  EXPECT_THAT(Matches("\\u{1F600}", "a\xF0\x9F\x98\x80"), ElementsAre("\xF0\x9F\x98\x80"));
  EXPECT_THAT(Matches("\\uD83D\\uDE00", "a\xF0\x9F\x98\x80"), ElementsAre("\xF0\x9F\x98\x80"));
  EXPECT_THAT(Matches("\\p{L}+", "abc 한국어 123"), ElementsAre("abc", "한국어"));
  EXPECT_THAT(Matches("\\p{N}{1,3}", "12345٣٤"), ElementsAre("123", "45٣", "٤"));
  // \d and \w stay ASCII, as in JavaScript.
  EXPECT_THAT(Matches("\\d+", "12٣٤34"), ElementsAre("12", "34"));
  EXPECT_THAT(Matches("\\w+", "abcé_1"), ElementsAre("abc", "_1"));
}

TEST(JsRegexTest, EmptyMatchesAdvanceOneCodePoint) {
  EXPECT_THAT(Matches("x*", "a\xC3\xA9"), ElementsAre("", "", ""));
  EXPECT_THAT(Matches("(?=b)", "abab"), ElementsAre("", ""));
}

TEST(JsRegexTest, DollarMatchesOnlyAtTheEnd) {
  EXPECT_THAT(Matches("a$", "a\n"), ElementsAre());
  EXPECT_THAT(Matches("a$", "ba"), ElementsAre("a"));
}

TEST(JsRegexTest, EmptyAndNegatedEmptyClasses) {
  EXPECT_THAT(Matches("a[]", "aa"), ElementsAre());
  EXPECT_THAT(Matches("[^]", "a\n"), ElementsAre("a", "\n"));
}

TEST(JsRegexTest, AppliesTheReferenceRewrites) {
  EXPECT_EQ(ApplyReferenceRewrites("\\#\\&\\~\\d"), "#&~\\d");
  EXPECT_EQ(ApplyReferenceRewrites("(?i:'s|'t|'re|'ve|'m|'ll|'d)|x"),
            "(?:'([sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))|x");
  // Spelled out, the contraction group does not fold U+017F (long s) the way (?i) would.
  EXPECT_THAT(Matches("(?i:'s|'t|'re|'ve|'m|'ll|'d)", "'S 's '\xC5\xBF 'LL"), ElementsAre("'S", "'s", "'LL"));
}

TEST(JsRegexTest, LlamaPatternSplitsLikeTheReference) {
  const std::string pattern =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  EXPECT_THAT(Matches(pattern, "I'LL pay 12345 now!!\n\n  x"),
              ElementsAre("I", "'LL", " pay", " ", "123", "45", " now", "!!\n\n", " ", " x"));
}

TEST(JsRegexTest, LiteralPatterns) {
  std::unique_ptr<JsRegex> literal = JsRegex::Literal("a.b");
  std::vector<MatchSpan> spans;
  ASSERT_THAT(literal->FindAll("xa.bya.b", &spans), IsOk());
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].begin, 1u);
  EXPECT_EQ(spans[1].begin, 5u);
}

TEST(JsRegexTest, ReportsBadPatterns) {
  EXPECT_THAT(JsRegex::Compile("(unclosed"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(unclosed")));
  EXPECT_THAT(JsRegex::Compile("[\\S]"), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("\\S inside")));
  EXPECT_THAT(JsRegex::Compile("\\u12"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\\u escape")));
  EXPECT_THAT(JsRegex::Compile("abc\\"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backslash")));
}

TEST(JsRegexTest, LongRunsDoNotExhaustTheStack) {
  const std::string spaces(200000, ' ');
  EXPECT_THAT(Matches("\\s+(?!\\S)|\\s+", spaces + "x"), ElementsAre(spaces.substr(1), " "));
}

}  // namespace
}  // namespace nq::tokenizer
