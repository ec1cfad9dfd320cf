// UTF-8 decoding with maximal-subpart replacement (services/tokenizer/utf8.h).
#include "services/tokenizer/utf8.h"

#include <gtest/gtest.h>

#include "tests/tokenizer/test_data.h"

namespace nq::tokenizer {
namespace {

constexpr std::string_view kFffd = "\xEF\xBF\xBD";

std::string Repeat(std::string_view s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out.append(s);
  return out;
}

struct Case {
  const char* name;
  std::string input;
  std::string output;
  int64_t replaced;
};

std::vector<Case> Cases() {
  const std::string r(kFffd);
  return {
      {"ascii", "plain", "plain", 0},
      {"valid_multibyte", "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", 0},
      {"literal_fffd_is_valid", r, r, 0},
      // Unicode 15, Table 3-8 (U+FFFD for non-shortest forms / ill-formed subsequences).
      {"unicode_table_3_8", "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64",
       "a" + r + r + r + "b" + r + "c" + r + r + "d", 6},
      {"lone_continuations", "\x80\xBF", r + r, 2},
      {"overlong_two_byte", "\xC0\xAF", r + r, 2},
      {"overlong_three_byte", "\xE0\x80\xAF", r + r + r, 3},
      {"surrogate", "\xED\xA0\x80", r + r + r, 3},
      {"above_u10ffff", "\xF4\x90\x80\x80", Repeat(r, 4), 4},
      {"never_valid_bytes", "\xF5\xFE\xFF", Repeat(r, 3), 3},
      {"truncated_at_end", "ok\xF0\x9F\x98", "ok" + r, 1},
      {"truncated_then_ascii", "\xE2\x82 x", r + " x", 1},
      {"truncated_then_lead", "\xE2\x82\xE2\x82\xAC", r + "\xE2\x82\xAC", 1},
      {"max_code_point", "\xF4\x8F\xBF\xBF", "\xF4\x8F\xBF\xBF", 0},
  };
}

TEST(Utf8Test, SanitizeReplacesEachMaximalSubpartOnce) {
  for (const Case& c : Cases()) {
    int64_t replaced = -1;
    EXPECT_EQ(SanitizeUtf8(c.input, &replaced), c.output) << c.name;
    EXPECT_EQ(replaced, c.replaced) << c.name;
    EXPECT_EQ(IsValidUtf8(c.input), c.replaced == 0) << c.name;
    EXPECT_TRUE(IsValidUtf8(c.output)) << c.name;
  }
}

TEST(Utf8Test, AnyChunkingGivesTheSameOutputAndNeverSplitsACharacter) {
  for (const Case& c : Cases()) {
    for (size_t chunk = 1; chunk <= 4; ++chunk) {
      Utf8Decoder decoder;
      std::string out;
      int64_t replaced = 0;
      for (size_t i = 0; i < c.input.size(); i += chunk) {
        std::string piece;
        replaced += decoder.Feed(std::string_view(c.input).substr(i, chunk), &piece);
        EXPECT_TRUE(IsValidUtf8(piece)) << c.name << " chunk " << chunk;
        out += piece;
      }
      replaced += decoder.Flush(&out);
      EXPECT_EQ(out, c.output) << c.name << " chunk " << chunk;
      EXPECT_EQ(replaced, c.replaced) << c.name << " chunk " << chunk;
    }
  }
}

TEST(Utf8Test, HoldsAnIncompleteCharacterUntilItCompletes) {
  Utf8Decoder decoder;
  std::string out;
  EXPECT_EQ(decoder.Feed("\xF0\x9F", &out), 0);
  EXPECT_EQ(out, "");
  EXPECT_EQ(decoder.pending_bytes(), 2u);
  EXPECT_EQ(decoder.Feed("\x98", &out), 0);
  EXPECT_EQ(out, "");
  EXPECT_EQ(decoder.Feed("\x80!", &out), 0);
  EXPECT_EQ(out, "\xF0\x9F\x98\x80!");
  EXPECT_EQ(decoder.pending_bytes(), 0u);
  EXPECT_EQ(decoder.Flush(&out), 0);
}

TEST(Utf8Test, AgreesWithTheReferenceTextDecoderOnTheInvalidCorpusEntries) {
  // Llama 3 has no normalizer, so the reference's decoding of the ids of an invalid entry is
  // TextDecoder's reading of its bytes.
  const auto& corpus = testing::Corpus();
  const auto& expected = testing::Expected("llama3");
  int checked = 0;
  for (size_t e = 0; e < corpus.size(); ++e) {
    if (IsValidUtf8(corpus[e].bytes)) continue;
    EXPECT_EQ(SanitizeUtf8(corpus[e].bytes), expected[e].decoded) << corpus[e].name;
    ++checked;
  }
  EXPECT_GE(checked, 9);
}

TEST(Utf8Test, CodePointHelpers) {
  const std::string s = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";
  size_t i = 0;
  EXPECT_EQ(NextCodePoint(s, &i), U'a');
  EXPECT_EQ(NextCodePoint(s, &i), U'\u00e9');
  EXPECT_EQ(NextCodePoint(s, &i), U'\u20ac');
  EXPECT_EQ(NextCodePoint(s, &i), U'\U0001F600');
  EXPECT_EQ(i, s.size());
  std::string out;
  for (char32_t cp : {U'a', U'\u00e9', U'\u20ac', U'\U0001F600'}) AppendUtf8(cp, &out);
  EXPECT_EQ(out, s);
}

}  // namespace
}  // namespace nq::tokenizer
